"""Benchmark: context parallelism's tokens/s per rank and peak memory per rank on CPU ranks.

    python bench/context_parallel.py [--seq-lens 2048,4096,8192] [--degrees 2,4] [--rounds 3]
                                     [--steps 6] [--rotate-methods allgather,alltoall] [--out PATH]

Each run is one ``run_train.sh`` launch with the debug model in float32. At sequence length S a
context-parallel run of degree N trains N sequences of S tokens split over its N ranks (head and
tail chunks), so each rank holds S tokens per step, as the one-rank run of one sequence of S tokens
does: the same tokens per rank and the same attention span. Throughput is the median tokens/s per
rank of the steps after the first two (the warm-up), memory the peak of rank 0 as the trainer logs
it (on CPU its process's peak RSS). Each round runs every case once, so that the ratios against the
one-rank run of the same round and length compare runs under the same load; the table gives the
median over the rounds and the spread (min-max).

On a machine with fewer cores than ranks the ranks share cores: the tokens/s per rank of 4 ranks
on 2 cores is at most half of one rank alone before any communication.

Prints the table and writes ``bench/results/context_parallel.json``.
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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_STEPS = 2


def run_case(seq_len: int, degree: int, rotate: str, steps: int, work: str) -> dict[str, float]:
    """One launch: median tokens/s per rank after warm-up, rank 0's peak memory and the last loss."""
    dump = tempfile.mkdtemp(dir=work)
    options = [
        "--job.dump_folder", dump,
        "--job.cache_dir", os.path.join(work, "cache"),
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(degree),
        "--training.steps", str(steps),
        "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false",
        "--parallelism.context_parallel_degree", str(degree),
        "--parallelism.context_parallel_rotate_method", rotate,
    ]  # fmt: skip
    env = os.environ | {"NGPU": str(degree), "OMP_NUM_THREADS": "1", "MAX_RESTARTS": "0"}
    result = subprocess.run(
        [os.path.join(REPO, "run_train.sh"), *options], cwd=REPO, env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"seq {seq_len} cp {degree} {rotate} exited {result.returncode}:\n{result.stderr[-2000:]}")
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as lines:
        records = [json.loads(line) for line in lines]
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    return {
        "tps_per_rank": statistics.median(r["tps"] for r in timed),
        "memory_gib": max(r["memory_gib"] for r in records),
        "final_loss": records[-1]["loss"],
    }


def cases(seq_lens: list[int], degrees: list[int], rotates: list[str]) -> list[tuple[int, int, str]]:
    """(seq_len, degree, rotate method): the one-rank run of each length first."""
    return [(s, 1, "allgather") for s in seq_lens] + [(s, n, r) for s in seq_lens for n in degrees for r in rotates]


def summarize(rounds: list[dict[str, dict[str, float]]], keys: list[str]) -> list[dict[str, Any]]:
    """Per case: the medians and spreads over the rounds, and the ratios to the one-rank run of each round."""
    rows = []
    for key in keys:
        seq_len = key.split()[0]
        tps = [r[key]["tps_per_rank"] for r in rounds]
        ratios = [r[key]["tps_per_rank"] / r[f"{seq_len} 1 allgather"]["tps_per_rank"] for r in rounds]
        memory = [r[key]["memory_gib"] for r in rounds]
        rows.append(
            {
                "case": key,
                "tps_per_rank": statistics.median(tps),
                "tps_spread": [min(tps), max(tps)],
                "ratio_to_one_rank": statistics.median(ratios),
                "ratio_spread": [min(ratios), max(ratios)],
                "memory_gib": statistics.median(memory),
                "memory_spread": [min(memory), max(memory)],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| seq | ranks (cp) | rotate | tokens/s per rank, median (min-max) | vs 1 rank | peak memory per rank GiB |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        seq_len, degree, rotate = row["case"].split()
        low, high = row["tps_spread"]
        r_low, r_high = row["ratio_spread"]
        lines.append(
            f"| {seq_len} | {degree} | {rotate if degree != '1' else '-'} | {row['tps_per_rank']:,.0f} "
            f"({low:,.0f}-{high:,.0f}) | {row['ratio_to_one_rank']:.2f} ({r_low:.2f}-{r_high:.2f}) "
            f"| {row['memory_gib']:.2f} |"
        )
    return "\n".join(lines)


def write(path: str, rounds: list[dict[str, dict[str, float]]], keys: list[str]) -> list[dict[str, Any]]:
    """Summarizes the rounds so far and writes them with this run's command and machine; returns the rows."""
    rows = summarize(rounds, keys)
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
        "rounds": rounds,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(record, out, indent=1)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="2048,4096,8192")
    parser.add_argument("--degrees", default="2,4")
    parser.add_argument("--rotate-methods", default="allgather,alltoall")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "context_parallel.json"))
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    all_cases = cases(seq_lens, [int(n) for n in args.degrees.split(",")], args.rotate_methods.split(","))
    keys = [f"{s} {n} {r}" for s, n, r in all_cases]
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for number in range(args.rounds):
            results = {}
            for key, (seq_len, degree, rotate) in zip(keys, all_cases):
                results[key] = run_case(seq_len, degree, rotate, args.steps, work)
                print(f"round {number + 1} {key}: {results[key]}", file=sys.stderr, flush=True)
            rounds.append(results)
            # Written after every round: a run stopped early keeps the rounds it finished.
            rows = write(args.out, rounds, keys)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
