"""Benchmark: the dry run's per-rank peak memory against real runs of the same config.

    python bench/estimate_accuracy.py [--cases NAME,...] [--precisions float32,bfloat16] [--seq-len 128]

Each case is a model and a layout on 1 to 8 ranks. Its estimate is the dry run as rank 0 of that
world (fake process group and tensors); its real peak is rank 0's on real gloo ranks
(``torchrun``, one thread per rank), both tracked by MemTracker over the second of two training
steps (``bench/memory_worker.py``). Writes ``bench/results/estimate_accuracy.json`` and prints the
table (Markdown) with the estimate's error and the categories that differ. Exits 1 if a case
failed or missed 10%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "bench", "memory_worker.py")
MIB = 2**20
TOLERANCE = 0.10  # the bound on the estimate's error

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
PP2 += ["--parallelism.pipeline_parallel_microbatch_size", "1"]
CASES: dict[str, tuple[str, int, list[str]]] = {
    # name: (flavor, ranks, layout options); FSDP2 unless said
    **{f"debugmodel_{n}": ("debugmodel", n, []) for n in (1, 2, 4, 8)},
    "debugmodel_2_simple_fsdp": ("debugmodel", 2, ["--parallelism.data_parallel_impl", "simple_fsdp"]),
    "debugmodel_2_full_ac": ("debugmodel", 2, ["--activation_checkpoint.mode", "full"]),
    "debugmodel_4_fsdp2_tp2": ("debugmodel", 4, TP2),
    "debugmodel_4_pp2_fsdp2": ("debugmodel", 4, PP2),
    "debugmodel_8_dp2_tp2_pp2": ("debugmodel", 8, TP2 + PP2),
    **{f"debugmodel_wide_{n}": ("debugmodel_wide", n, []) for n in (1, 2, 4, 8)},
    **{f"debugmodel_200m_{n}": ("debugmodel_200m", n, []) for n in (1, 2, 4, 8)},
}


def _launch(command: list[str], out: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"exit {proc.returncode}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def run_case(flavor: str, ranks: int, layout: list[str], precision: str, args: argparse.Namespace) -> dict[str, Any]:
    options = ["--model.flavor", flavor, "--training.seq_len", str(args.seq_len)]
    options += ["--training.local_batch_size", "2", "--training.mixed_precision_param", precision, *layout]
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        fake_out, real_out = os.path.join(tmp, "fake.json"), os.path.join(tmp, "real.json")
        estimate = _launch([sys.executable, WORKER, fake_out, "--fake", str(ranks), *options], fake_out, args.timeout)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        real = _launch([*torchrun, WORKER, real_out, *options], real_out, args.timeout)
    est, got = estimate["peak"], real["peak"]
    return {
        "options": options,
        "estimate_bytes": est["Total"],
        "real_bytes": got["Total"],
        "error": est["Total"] / got["Total"] - 1,
        "estimate": est,
        "real": got,
        "differing": {k: est.get(k, 0) - got.get(k, 0) for k in got if k != "Total" and est.get(k, 0) != got[k]},
        "estimate_seconds": estimate["seconds"],
        "real_seconds": real["seconds"],
    }


def format_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| case | precision | estimate MiB | real MiB | error | categories that differ (estimate - real, MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        name, precision = key.rsplit("/", 1)
        if "failed" in r:
            lines.append(f"| {name} | {precision} | FAILED: {r['failed'].splitlines()[0]} | | | |")
            continue
        differing = ", ".join(f"{k} {v / MIB:+.1f}" for k, v in r["differing"].items()) or "none"
        lines.append(
            f"| {name} | {precision} | {r['estimate_bytes'] / MIB:.1f} | {r['real_bytes'] / MIB:.1f} "
            f"| {r['error']:+.1%} | {differing} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (default: all)")
    parser.add_argument("--precisions", default="float32,bfloat16", help="training.mixed_precision_param values")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "estimate_accuracy.json"))
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")

    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    results: dict[str, dict[str, Any]] = {}
    for name in args.cases.split(","):
        flavor, ranks, layout = CASES[name]
        for precision in args.precisions.split(","):
            key = f"{name}/{precision}"
            try:
                results[key] = run_case(flavor, ranks, layout, precision, args)
                print(f"{key}: estimate {results[key]['error']:+.2%} of real", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                results[key] = {"failed": str(e)}
                print(f"{key}: FAILED {e}", file=sys.stderr, flush=True)
    info = {
        "date": started,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "seq_len": args.seq_len,
        "local_batch_size": 2,
        "measured": "rank 0's peak of live tensors in the second of two training steps, MemTracker",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    print(format_table(results))
    print(f"wrote {args.out}")
    bad = [k for k, r in results.items() if "failed" in r or abs(r["error"]) > TOLERANCE]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
