"""Benchmark: step time with and without CPU offload (training.enable_cpu_offload), FSDP2 and SimpleFSDP.

    python bench/offload.py [--rounds N] [--steps N] [--warmup N] [--flavor debugmodel] [--seq-len N]
                            [--batch-size N] [--ranks N]

Each run is one torchrun launch of train.py (gloo, OMP_NUM_THREADS=1 per rank) in float32; each round
runs every variant once, in turn, so that variants compared share the machine's load. A run's step time
is the median of its steps after the warm-up (tokens per rank / the logged tokens per second); the table
gives the median over the rounds, the spread (min-max) and the ratio to the same implementation without
offload. On CPU ranks host and device memory are one: offload moves nothing, so this measures what its
path costs (the optimizer on host tensors, the copies that are no-ops here), not PCIe transfers.
Writes bench/results/offload.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results", "offload.json")
SIMPLE = ["--parallelism.data_parallel_impl", "simple_fsdp"]
OFFLOAD = ["--training.enable_cpu_offload"]
VARIANTS = {
    "fsdp2": [],
    "fsdp2_offload": OFFLOAD,
    "simple_fsdp": SIMPLE,
    "simple_fsdp_offload": [*SIMPLE, *OFFLOAD],
}


def run_once(args: argparse.Namespace, overrides: list[str]) -> list[float]:
    """Seconds of each step after the warm-up of one launch."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}"),
            "train.py",
            *("--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len)),
            *("--training.local_batch_size", str(args.batch_size), "--training.steps", str(args.warmup + args.steps)),
            *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.peak_flops", "1e12"),
            *("--training.mixed_precision_param", "float32", "--job.dump_folder", folder, *overrides),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, text=True)
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    tokens = args.seq_len * args.batch_size
    return [tokens / r["tps"] for r in records if r["step"] > args.warmup]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()

    per_round: dict[str, list[float]] = {name: [] for name in VARIANTS}
    steps: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
    for round_index in range(args.rounds):
        for name, overrides in VARIANTS.items():
            times = run_once(args, overrides)
            steps[name].append(times)
            per_round[name].append(statistics.median(times))
            print(f"round {round_index + 1}/{args.rounds} {name}: {per_round[name][-1] * 1e3:.1f} ms/step", flush=True)

    rows = []
    print(f"\n{'variant':<22} {'median ms':>10} {'min-max ms':>16} {'vs no offload':>14}")
    for name, values in per_round.items():
        base = statistics.median(per_round[name.removesuffix("_offload")])
        median = statistics.median(values)
        rows.append(
            {"variant": name, "median_s": median, "min_s": min(values), "max_s": max(values), "ratio": median / base}
        )
        spread = f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
        print(f"{name:<22} {median * 1e3:>10.1f} {spread:>16} {median / base:>13.2f}x")
    result = {
        "command": " ".join(["python", "bench/offload.py", *sys.argv[1:]]),
        "settings": vars(args),
        "rows": rows,
        "step_seconds": steps,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
