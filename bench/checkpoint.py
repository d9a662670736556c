"""Benchmark: distributed checkpoint save and load times of the trainer on 2 CPU ranks.

    python bench/checkpoint.py [--repeats 3] [--flavors debugmodel,debugmodel_wide] [--seq-len 128]

Every flavor is one ``torchrun --nproc-per-node 2`` launch of ``bench/checkpoint_worker.py`` (gloo,
``OMP_NUM_THREADS=1`` per rank, FSDP2 as the trainer defaults to) after one training step, so the
checkpoint holds model, AdamW state, LR schedule, data position and step. Measured per repetition:
synchronous save; async save, blocked (``save()`` plus the wait for the state copy that is left
after the next forward and backward, before the update) and total (from ``save()`` until written,
that forward and backward included); resume at the same layout; resume at TP 2 (resharded). Reported:
medians of the times and of the per-repetition ratios; on a shared machine the ratios are what
to compare, absolute seconds are noise.
Writes ``bench/results/checkpoint.json``. Exits 1 if a flavor failed.
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

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "bench", "checkpoint_worker.py")
NPROC = 2
MIB = 2**20
MEASURES = ("sync_save", "async_blocked", "async_total", "load", "load_tp2")
# name: (numerator, denominator), both measured in the same repetition
RATIOS = {
    "async_blocked/sync_save": ("async_blocked", "sync_save"),
    "async_total/sync_save": ("async_total", "sync_save"),
    "load/sync_save": ("load", "sync_save"),
    "load_tp2/load": ("load_tp2", "load"),
}


def run_flavor(flavor: str, args: argparse.Namespace) -> dict[str, Any]:
    """One launch; returns the worker's result, or raises RuntimeError with the log's tail."""
    overrides = ["--model.flavor", flavor, "--training.seq_len", str(args.seq_len), "--training.local_batch_size", "2"]
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        out = os.path.join(tmp, "result.json")
        torchrun = f"-m torch.distributed.run --standalone --nproc-per-node={NPROC} {WORKER}"
        worker_args = f"--root {tmp} --out {out} --repeats {args.repeats} --"
        command = [sys.executable, *torchrun.split(), *worker_args.split(), *overrides]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        log_path = os.path.join(tmp, "log.txt")
        with open(log_path, "w") as log:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                returncode = process.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                process.terminate()  # torchrun stops its ranks on SIGTERM (a SIGKILL would orphan them)
                process.wait()
                raise RuntimeError(f"timed out after {args.timeout:.0f} s") from None
        if returncode != 0 or not os.path.exists(out):
            with open(log_path, errors="replace") as f:
                tail = "\n".join(f.read().splitlines()[-20:])
            raise RuntimeError(f"torchrun exited with code {returncode}:\n{tail}")
        with open(out) as f:
            result = json.load(f)
    result["overrides"] = overrides
    return result


def summarize(result: dict[str, Any]) -> None:
    times = result["times_s"]
    result["median_s"] = {m: statistics.median(times[m]) for m in MEASURES}
    # Measures of one repetition run seconds apart and share the machine's load: median of their ratios.
    result["ratios"] = {
        name: statistics.median([a / b for a, b in zip(times[num], times[den])]) for name, (num, den) in RATIOS.items()
    }


def format_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| model | params | checkpoint MiB | sync save s | async blocked s | async total s | blocked / sync "
        "| load s | TP2 load s | load / sync save | TP2 load / load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for flavor, r in results.items():
        if "error" in r:
            lines.append(f"| {flavor} | FAILED: {r['error'].splitlines()[0]} |")
            continue
        m, q = r["median_s"], r["ratios"]
        lines.append(
            f"| {flavor} | {r['params'] / 1e6:.1f}M | {r['checkpoint_bytes'] / MIB:.0f} | {m['sync_save']:.2f} "
            f"| {m['async_blocked']:.3f} | {m['async_total']:.2f} | {q['async_blocked/sync_save']:.1%} "
            f"| {m['load']:.2f} | {m['load_tp2']:.2f} | {q['load/sync_save']:.2f} | {q['load_tp2/load']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every measure (default 3)")
    parser.add_argument("--flavors", default="debugmodel,debugmodel_wide", help="comma-separated model flavors")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length of the one training step")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one flavor may take")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "checkpoint.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "world_size": NPROC,
        "omp_num_threads_per_rank": 1,
        "loadavg_start": os.getloadavg(),
    }
    results: dict[str, dict[str, Any]] = {}
    for flavor in args.flavors.split(","):
        print(f"{flavor}: {args.repeats} repetitions ...", flush=True)
        try:
            results[flavor] = run_flavor(flavor, args)
            summarize(results[flavor])
        except RuntimeError as e:
            results[flavor] = {"error": str(e)}
            print(f"FAILED: {e}", file=sys.stderr)
    info["loadavg_end"] = os.getloadavg()

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        settings = {
            "repeats": args.repeats,
            "seq_len": args.seq_len,
            "layout": "FSDP2 over 2 ranks; one untimed save per mode before the repetitions",
            "resharded_load": "the FSDP2 checkpoint resumed at tensor parallel degree 2 (no FSDP)",
            "ratios": "median over the repetitions of the ratio within each repetition",
        }
        json.dump({"machine": info, "settings": settings, "results": results}, f, indent=1)
    print()
    print(format_table(results))
    print(
        "\nMedians over the repetitions (ratios: of the per-repetition ratios); each time is the slowest rank's.\n"
        "blocked = async save() + the copy's remainder after a forward/backward; total = save() until written,\n"
        "the forward/backward included. TP2 load: the 2-rank FSDP2 checkpoint resumed at tensor parallel\n"
        f"degree 2 (no FSDP). Results in {os.path.relpath(args.out, REPO)}"
    )
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
