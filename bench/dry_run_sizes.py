"""Benchmark: the dry run's per-rank peak memory at real model sizes, and how long each estimate took.

    python bench/dry_run_sizes.py [--models 8B,70B,405B] [--variants fsdp2,...] [--ac none,full]

Each row is one ``python -m programs.dry_run``-equivalent process (``bench/memory_worker.py
--fake``) playing rank 0 of the model's layout: 8B on 8 ranks (FSDP 8), 70B on 64 (FSDP 8 x TP 8)
and 405B on 512 (FSDP 32 x TP 8 x PP 2, 1F1B), at vocabulary 128,256, seq 8192, one sequence per
microbatch, bf16 compute with fp32 master weights, gradients and optimizer state. Variants: FSDP2,
and compiled SimpleFSDP with bucketing none, manual (one bucket per block) and auto (planned with
``AUTO_FIGURES``: an H100 node's links and 40% of its bf16 peak). Compiled SimpleFSDP's peak is
the eager run's measured peak plus the analytical gathered weights of its two largest neighbouring
buckets. Writes ``bench/results/dry_run_sizes.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "bench", "memory_worker.py")
GIB = 2**30

MODELS = {
    # name: (ranks, layout options)
    "8B": (8, []),
    "70B": (64, ["--parallelism.tensor_parallel_degree", "8"]),
    "405B": (
        512,
        [
            *("--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree", "2"),
            *(
                "--parallelism.pipeline_parallel_schedule",
                "1F1B",
                "--parallelism.pipeline_parallel_microbatch_size",
                "1",
            ),
            *("--training.local_batch_size", "2"),
        ],
    ),
}
SIMPLE_FSDP = ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.bucketing"]
AUTO_FIGURES = ["--comm.alpha_us", "10", "--comm.bandwidth_gbps", "450", "--compile.compute_flops", "3.96e14"]
VARIANTS = {
    "fsdp2": [],
    "simple_fsdp_none": [*SIMPLE_FSDP, "none"],
    "simple_fsdp_manual": [*SIMPLE_FSDP, "manual"],
    "simple_fsdp_auto": [*SIMPLE_FSDP, "auto", *AUTO_FIGURES],
}
COMMON = [
    *("--training.seq_len", "8192", "--training.local_batch_size", "1"),
    *("--training.mixed_precision_param", "bfloat16"),
]


def run(model: str, variant: str, ac: str, timeout: float) -> dict[str, Any]:
    ranks, layout = MODELS[model]
    argv = [*COMMON, "--model.flavor", model, *layout, *VARIANTS[variant], "--activation_checkpoint.mode", ac]
    with tempfile.TemporaryDirectory(prefix="bench_dry_run_") as tmp:
        out = os.path.join(tmp, "out.json")
        env = dict(os.environ, PYTHONPATH=REPO)
        proc = subprocess.run(
            [sys.executable, WORKER, out, "--fake", str(ranks), *argv],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError("\n".join(proc.stderr.splitlines()[-5:]))
        with open(out) as f:
            result = json.load(f)
    report = result["report"]
    return {
        "argv": argv,
        "ranks": ranks,
        "peak_bytes": report["peak_bytes"] + report["bucket_pair_bytes"],
        "eager_peak_bytes": report["peak_bytes"],
        "bucket_pair_bytes": report["bucket_pair_bytes"],
        "buckets": report["buckets"],
        "breakdown": report["peak"],
        "dry_run_seconds": report["seconds"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ac", default="none,full", help="activation_checkpoint.mode values")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one dry run may take")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "dry_run_sizes.json"))
    args = parser.parse_args(argv)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    rows: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        for ac in args.ac.split(","):
            for variant in args.variants.split(","):
                key = f"{model}/{variant}/{ac}"
                try:
                    rows[key] = run(model, variant, ac, args.timeout)
                    print(f"{key}: {rows[key]['peak_bytes'] / GIB:.2f} GiB", flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    rows[key] = {"failed": str(e)}
                    print(f"{key}: FAILED {e}", file=sys.stderr, flush=True)
    lines = [
        "| model | ranks | data parallel | AC | peak per rank GiB | of which buckets GiB (analytical) | dry run s |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        model, variant, ac = key.split("/")
        if "failed" in r:
            lines.append(f"| {model} | | {variant} | {ac} | FAILED: {r['failed'].splitlines()[-1]} | | |")
            continue
        buckets = "-" if r["buckets"] is None else f"{r['bucket_pair_bytes'] / GIB:.2f} ({r['buckets']} buckets)"
        lines.append(
            f"| {model} | {r['ranks']} | {variant} | {ac} | {r['peak_bytes'] / GIB:.2f} | {buckets} "
            f"| {r['dry_run_seconds']:.0f} |"
        )
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"info": {"date": started, "common": COMMON, "auto_figures": AUTO_FIGURES}, "rows": rows}, f, indent=1
        )
    print(f"wrote {args.out}")
    return 1 if any("failed" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
