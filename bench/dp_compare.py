"""Benchmark: FSDP2 against SimpleFSDP (eager and compiled, three bucketing modes) on 2 CPU ranks.

    python bench/dp_compare.py [--models debugmodel,debugmodel_wide] [--variants v1,v2,...]
                               [--steps N] [--warmup N] [--seq-len N] [--batch-size N] [--quick]

Every (model, variant) is one ``torchrun --nproc-per-node 2`` launch of ``bench/dp_compare_worker.py``
(gloo, ``OMP_NUM_THREADS=1`` per rank), which builds the run with the trainer's own code from
``configs/debug_model.toml`` plus the variant's overrides: same data, seed and global batch for all.
The variants of one model run back to back, so their ratios share the machine's conditions;
absolute numbers on a shared machine are noise, ratios against ``fsdp2_eager`` are the result.

Prints one table row per (model, variant) and writes ``bench/results/dp_compare.json``
(``dp_compare_quick.json`` with ``--quick``): all numbers, per-step times and losses, machine info.
Each launch's output goes to ``bench/results/dp_compare_logs/``. Exits 1 if any variant failed
(the others still run). On an idle 2-core machine ``--quick`` takes about 4 minutes, nearly all of
it the four cold Inductor compiles, and the full run about 10 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch

from models.llama3 import llama3_flavors

WORKER = os.path.join(REPO, "bench", "dp_compare_worker.py")
RESULTS_DIR = os.path.join(REPO, "bench", "results")
NPROC = 2
MIB = 2**20

SIMPLE_FSDP_COMPILED = "--parallelism.data_parallel_impl simple_fsdp --compile.enable --compile.backend inductor"
VARIANTS: dict[str, list[str]] = {
    name: flags.split()
    for name, flags in {
        "fsdp2_eager": "--parallelism.data_parallel_impl fsdp2",
        "fsdp2_compile": "--parallelism.data_parallel_impl fsdp2 --compile.enable --compile.backend inductor",
        "simplefsdp_eager": "--parallelism.data_parallel_impl simple_fsdp",
        "simplefsdp_none": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing none",
        "simplefsdp_manual": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing manual",
        "simplefsdp_auto": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing auto",
    }.items()
}
BASELINE = "fsdp2_eager"


@dataclass(frozen=True)
class Shape:
    """Per-rank microbatch of one model: sequence length and sequences."""

    seq_len: int
    batch_size: int


# Sized for a 2-core machine: debugmodel at the trainer's default sequence length; the wide
# model (about 9x the parameters) with 4x fewer tokens so that its steps take about as long.
DEFAULT_SHAPES = {"debugmodel": Shape(256, 4), "debugmodel_wide": Shape(128, 2)}
DEFAULT_WARMUP, DEFAULT_STEPS = 2, 8
QUICK_MODELS, QUICK_SHAPE, QUICK_WARMUP, QUICK_STEPS = ["debugmodel"], Shape(32, 1), 1, 2

MEMORY_METHOD = (
    "tracked = live tensor storage bytes at the start of a step (gc scan of plain CPU tensors, "
    "deduplicated by storage; parameters, buffers, optimizer state) + the step's peak of CPU-allocator "
    "bytes above that start (torch.profiler profile_memory events; includes Inductor's buffers). "
    "RSS = peak resident set size of the process over the timed steps (includes the Python runtime)."
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated flavors (default: {','.join(DEFAULT_SHAPES)})")
    parser.add_argument("--variants", help=f"comma-separated, from: {','.join(VARIANTS)} (default: all)")
    parser.add_argument("--steps", type=int, help=f"timed steps per variant (default {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=int, help=f"untimed steps first, compile included (default {DEFAULT_WARMUP})")
    parser.add_argument("--seq-len", type=int, help="sequence length for every model (default: per model)")
    parser.add_argument("--batch-size", type=int, help="sequences per rank for every model (default: per model)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny check that everything runs: {','.join(QUICK_MODELS)}, seq_len {QUICK_SHAPE.seq_len}, "
        f"batch {QUICK_SHAPE.batch_size}, {QUICK_WARMUP} warm-up + {QUICK_STEPS} timed steps "
        "(explicit options still win)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one variant may take (default 1800)")
    parser.add_argument(
        "--out", help="result JSON (default bench/results/dp_compare.json, dp_compare_quick.json with --quick)"
    )
    args = parser.parse_args(argv)

    models = args.models.split(",") if args.models else (QUICK_MODELS if args.quick else list(DEFAULT_SHAPES))
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    # Checked here rather than by the workers, so that a typo does not surface minutes into a run.
    unknown_models = [m for m in models if m not in llama3_flavors]
    if unknown_models:
        parser.error(f"unknown models {unknown_models}; known: {', '.join(llama3_flavors)}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    args.models, args.variants = models, variants
    args.warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else DEFAULT_WARMUP)
    args.steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step compiles)")
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    args.out = args.out or os.path.join(RESULTS_DIR, "dp_compare_quick.json" if args.quick else "dp_compare.json")
    return args


def model_shape(model: str, args: argparse.Namespace) -> Shape:
    default = QUICK_SHAPE if args.quick else DEFAULT_SHAPES.get(model, DEFAULT_SHAPES["debugmodel"])
    return Shape(args.seq_len or default.seq_len, args.batch_size or default.batch_size)


def machine_info() -> dict[str, Any]:
    cpu_model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "nproc_per_variant": NPROC,
        "omp_num_threads_per_rank": 1,
        "loadavg_start": os.getloadavg(),
    }


def stop_launch(process: subprocess.Popen) -> None:
    """Stops a torchrun launch and its ranks. The ranks run in sessions of their own, so only
    torchrun can end them: SIGTERM makes it stop them and exit; SIGKILL if it does not in time."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_variant(model: str, variant: str, shape: Shape, args: argparse.Namespace, log_path: str) -> dict[str, Any]:
    """Launches one variant and returns the worker's result. Raises RuntimeError when the launch
    fails and subprocess.TimeoutExpired after ``--timeout`` seconds (the launch is killed)."""
    # The warm-up stays within the shortest run's step count (the base config warms up over 6 steps).
    overrides = [
        *f"--model.flavor {model} --training.seq_len {shape.seq_len} --training.local_batch_size {shape.batch_size}"
        f" --lr_scheduler.warmup_steps {min(6, args.warmup + args.steps)}".split(),
        *VARIANTS[variant],
    ]
    with tempfile.TemporaryDirectory(prefix="dp_compare_") as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=REPO,
            # The FX graph cache would skip the bucketing pass on a hit (no graph reports), and a
            # fresh Inductor cache per launch makes every variant pay its own full (cold) compile.
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
            TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
            # Compile in the rank's own process: both cores already run a rank.
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        torchrun = f"-m torch.distributed.run --standalone --nproc-per-node={NPROC} {WORKER}"
        worker_args = f"--out {out} --warmup {args.warmup} --steps {args.steps} --"
        command = [sys.executable, *torchrun.split(), *worker_args.split(), *overrides]
        with open(log_path, "w") as log:
            log.write(" ".join(command) + "\n\n")
            log.flush()
            process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = process.wait(timeout=args.timeout)
            except BaseException:
                stop_launch(process)
                raise
        if returncode != 0 or not os.path.exists(out):
            cause = first_traceback(log_path).splitlines()[-1:] or [""]
            raise RuntimeError(f"torchrun exited with code {returncode}: {cause[0].strip()}")
        with open(out) as f:
            result = json.load(f)
    result["overrides"] = overrides
    return result


EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*")


def first_traceback(path: str, max_lines: int = 30) -> str:
    """The first Python traceback in a log (a worker's own error, before torchrun's summary of
    it), or the log's last lines when there is none."""
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    if start is None:
        return "\n".join(lines[-max_lines:])
    end = next((i for i in range(start + 1, len(lines)) if EXCEPTION_LINE.match(lines[i])), len(lines) - 1)
    return "\n".join(lines[max(start, end + 1 - max_lines) : end + 1])


def add_ratios(results: list[dict[str, Any]]) -> None:
    """tokens/s and tracked-memory ratios against the same model's FSDP2 eager run."""
    baselines = {r["model"]: r for r in results if r["variant"] == BASELINE and r["ok"]}
    for r in results:
        base = baselines.get(r["model"])
        ok = r["ok"] and base is not None
        r["tps_ratio"] = r["tps_total"] / base["tps_total"] if ok else None
        r["memory_ratio"] = r["memory"]["tracked_peak_bytes"] / base["memory"]["tracked_peak_bytes"] if ok else None


def graph_note(r: dict[str, Any]) -> str | None:
    """Compiled SimpleFSDP: the collectives the bucketing pass left in the graphs, checked against
    the collectives the profiled step actually issued."""
    reports = r.get("graph_reports")
    if not r["ok"] or not reports:
        return None
    if len(reports) < 2:
        return f"{r['model']} {r['variant']}: only {len(reports)} graph compiled, expected forward and backward"
    forward, backward = reports[-2]["collectives"], reports[-1]["collectives"]
    in_graphs = {k: forward.get(k, 0) + backward.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    runtime = r["collectives"]
    agrees = (
        in_graphs["all_gather"] == runtime["all_gather"] and in_graphs["reduce_scatter"] == runtime["reduce_scatter"]
    )
    buckets = "per-parameter" if r["buckets"] is None else f"{len(r['buckets'])} buckets"
    note = (
        f"{r['model']} {r['variant']}: {buckets}; graphs fw AG {forward.get('all_gather', 0)}, "
        f"bw AG {backward.get('all_gather', 0)} RS {backward.get('reduce_scatter', 0)} "
        f"AR {in_graphs['all_reduce']}; "
        + ("matches the profiled step" if agrees else "DIFFERS from the profiled step (AG/RS)")
    )
    if len(reports) > 2:
        note += f"; {len(reports)} graphs compiled (recompilation)"
    return note


def _ratio(value: float | None) -> str:
    return f"{value:6.2f}" if value is not None else f"{'-':>6}"


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'model':<16} {'variant':<18} {'tok/s/rank':>10} {'tok/s':>8} {'x tps':>6} {'mem MiB':>8} {'x mem':>6} "
        f"{'RSS GiB':>7} {'AG':>4} {'RS':>4} {'AR':>4} {'MiB/step':>8} {'wire MiB':>8} {'3P(N-1)/N':>9} "
        f"{'compile s':>9} {'loss':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if not r["ok"]:
            lines.append(f"{r['model']:<16} {r['variant']:<18} FAILED: {r['error']}")
            continue
        c = r["collectives"]
        lines.append(
            f"{r['model']:<16} {r['variant']:<18} {r['tps_per_rank']:>10.0f} {r['tps_total']:>8.0f} "
            f"{_ratio(r['tps_ratio'])} {r['memory']['tracked_peak_bytes'] / MIB:>8.1f} {_ratio(r['memory_ratio'])} "
            f"{r['memory']['peak_rss_gib']:>7.2f} {c['all_gather']:>4} {c['reduce_scatter']:>4} {c['all_reduce']:>4} "
            f"{r['payload_bytes'] / MIB:>8.1f} {r['wire_bytes_estimate'] / MIB:>8.1f} {r['theory_bytes'] / MIB:>9.1f} "
            f"{r['compile_s']:>9.1f} {r['final_loss']:>7.4f}"
        )
    return "\n".join(lines)


LEGEND = f"""\
tok/s/rank, tok/s: tokens per rank / over both ranks, per second of the timed steps (the slowest rank's
  step time each step; data loading excluded). x tps, x mem: ratio to the same model's {BASELINE}.
mem MiB: peak tracked tensor memory per rank (max over ranks). RSS GiB: peak resident set size.
AG/RS/AR: all-gathers, reduce-scatters, all-reduces one rank issues in one step (profiled step,
  ProcessGroup-level c10d ops: model, gradient clipping and loss all-reduce).
MiB/step: their sizes (all-gather output, reduce-scatter input, all-reduce buffer). wire MiB: what a ring
  algorithm sends per rank for them: size x (N-1)/N, all-reduce twice that. 3P(N-1)/N: FSDP's theoretical
  wire bytes, 3 x parameter bytes P x (N-1)/N (all-gather forward and backward, reduce-scatter gradients).
compile s: first step minus the median timed step, with a fresh Inductor cache per run: the compile for
  compiled variants, one-time set-up (lazy init, optimizer state) for eager ones.
loss: global loss at the last timed step (same data and seed everywhere: the variants should agree)."""


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    log_dir = os.path.join(RESULTS_DIR, "dp_compare_logs")
    os.makedirs(log_dir, exist_ok=True)
    info = machine_info()
    runs = [(m, v) for m in args.models for v in args.variants]
    print(
        f"dp_compare: {len(runs)} runs on {NPROC} ranks, warm-up {args.warmup} + {args.steps} timed steps; "
        f"torch {info['torch']}, {info['usable_cores']} cores, load average {info['loadavg_start'][0]:.1f}",
        flush=True,
    )
    start = time.perf_counter()
    results = run_all(runs, args, log_dir)
    add_ratios(results)
    info["loadavg_end"] = os.getloadavg()
    info["total_wall_s"] = time.perf_counter() - start
    write_results(args, info, results)
    print()
    print(format_table(results))
    notes = [n for r in results if (n := graph_note(r))]
    if notes:
        print("\nCompiled SimpleFSDP graphs (BucketingPass reports):\n  " + "\n  ".join(notes))
    print(f"\n{LEGEND}\nMemory: {MEMORY_METHOD}")
    print(f"\nTotal {info['total_wall_s'] / 60:.1f} min; results in {os.path.relpath(args.out, REPO)}")

    failed = [r for r in results if not r["ok"]]
    for r in failed:
        traceback = first_traceback(os.path.join(REPO, r["log"]))
        print(f"\nFAILED {r['model']} {r['variant']}: {r['error']}\nfrom {r['log']}:\n{traceback}", file=sys.stderr)
    if failed:
        print(f"error: {len(failed)} of {len(results)} runs failed", file=sys.stderr)
        return 1
    return 0


def run_all(runs: list[tuple[str, str]], args: argparse.Namespace, log_dir: str) -> list[dict[str, Any]]:
    """Every (model, variant) launch, one after the other; a failed one is recorded and skipped."""
    results: list[dict[str, Any]] = []
    for i, (model, variant) in enumerate(runs, 1):
        shape = model_shape(model, args)
        log_path = os.path.join(log_dir, f"{model}_{variant}.log")
        print(
            f"[{i}/{len(runs)}] {model} {variant} (seq_len {shape.seq_len}, batch {shape.batch_size}/rank) ... ",
            end="",
            flush=True,
        )
        run_start = time.perf_counter()
        entry: dict[str, Any] = {"model": model, "variant": variant, "log": os.path.relpath(log_path, REPO)}
        try:
            entry |= run_variant(model, variant, shape, args, log_path)
            entry |= {"ok": True, "error": None}
            print(f"{time.perf_counter() - run_start:.0f} s", flush=True)
        except subprocess.TimeoutExpired:
            entry |= {"ok": False, "error": f"timed out after {args.timeout:.0f} s (--timeout)"}
            print(f"FAILED ({entry['error']}), see {entry['log']}", flush=True)
        except RuntimeError as e:
            entry |= {"ok": False, "error": str(e)}
            print(f"FAILED ({e}), see {entry['log']}", flush=True)
        entry["wall_s"] = time.perf_counter() - run_start
        results.append(entry)
    return results


def write_results(args: argparse.Namespace, info: dict[str, Any], results: list[dict[str, Any]]) -> None:
    with open(args.out, "w") as f:
        json.dump(
            {
                "machine": info,
                "settings": {
                    "models": args.models,
                    "variants": args.variants,
                    "shapes": {m: vars(model_shape(m, args)) for m in args.models},
                    "warmup_steps": args.warmup,
                    "timed_steps": args.steps,
                    "quick": args.quick,
                },
                "memory_method": MEMORY_METHOD,
                "variants": {v: VARIANTS[v] for v in args.variants},
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
