"""Benchmark: FSDP2 against SimpleFSDP (eager and compiled, four bucketing modes) on CPU ranks.

    python bench/dp_compare.py [--models debugmodel,debugmodel_wide] [--variants v1,v2,...]
                               [--manual-plan NAME=BUCKETS ...]
                               [--precisions fp32,bf16,bf16_pure] [--ranks 1,2] [--rounds N]
                               [--steps N] [--warmup N] [--seq-len N] [--batch-size N] [--quick]
    python bench/dp_compare.py --interleave [--models ...] [--variants ...] [--precisions ...] [--ranks ...]
    python bench/dp_compare.py --compile-depths 6,16,32

Every run is one ``torchrun`` launch of ``bench/dp_compare_worker.py`` (gloo, ``OMP_NUM_THREADS=1``
per rank), which builds the run with the trainer's own code from ``configs/debug_model.toml`` plus
the variant's overrides: same data, seed and per-rank batch for all. Each round runs every
(model, precision, ranks, variant) once, so that ratios compare runs made under the same load; the
table gives the median over the rounds and the spread (min-max). Absolute numbers on a shared
machine are noise; the ratios against ``fsdp2_eager`` (same model, precision, ranks and round) are
the result. The 1-rank runs (``--ranks 1,2``; only ``ONE_RANK_VARIANTS``) give the scaling
efficiency: tokens/s per rank on 2 ranks over tokens/s on 1 rank, same variant. ``--ceiling`` adds
what the machine allows: as many 1-rank runs as the largest rank count, launched at once and
independent (no communication), over one alone; the ranks of a data-parallel run share the cores,
memory and caches the same way, and communicate on top.

``--interleave`` runs every variant of a (model, precision, ranks) in one launch instead, its
steps alternating with the others' (``bench/dp_compare_worker.py``), so that a change of the
machine's load between launches, which on a shared machine moves a ratio by more than 10%, falls
on every variant alike. It measures step times and losses only; the table gives each step's time
over the ``fsdp2_eager`` step next to it, over all rounds: median and quartiles.

``--manual-plan`` adds hand-written bucket plans as variants of their own, to set the auto
planner against the best plan one can write for the same model in the same rounds.

``--compile-depths`` measures compile time instead, in fp32: for each depth (debugmodel's width),
FSDP2's per-block compile, SimpleFSDP's per-block compile (block bucketing) and its whole-model
compile with auto buckets (``DEPTH_VARIANTS``, or those of them ``--variants`` names), each
launched twice on one fresh Inductor cache: cold, then as a restart of the same job would (warm
caches).

Prints the table and writes ``bench/results/dp_compare.json`` (``dp_compare_quick.json`` with
``--quick``, ``dp_compare_depth.json`` for depths): all numbers, per-step times and losses, machine
info. Each launch's output goes to ``bench/results/dp_compare_logs/``. Exits 1 if any run failed
(the others still run). On an idle 2-core machine ``--quick`` takes about 4 minutes and one round of
the full table about 25 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch

from models.llama3 import llama3_flavors

WORKER = os.path.join(REPO, "bench", "dp_compare_worker.py")
RESULTS_DIR = os.path.join(REPO, "bench", "results")
MIB = 2**20

SIMPLE_FSDP_COMPILED = "--parallelism.data_parallel_impl simple_fsdp --compile.enable --compile.backend inductor"
VARIANTS: dict[str, list[str]] = {
    name: flags.split()
    for name, flags in {
        "fsdp2_eager": "--parallelism.data_parallel_impl fsdp2",
        # Each parameter updated in backward, its gradient freed there (nothing clipped).
        "fsdp2_early_step": "--parallelism.data_parallel_impl fsdp2 --optimizer.early_step_in_backward",
        "fsdp2_compile": "--parallelism.data_parallel_impl fsdp2 --compile.enable --compile.backend inductor",
        # torchao's float8 linear layers (the output's left out), weights gathered in float8.
        "fsdp2_float8": "--parallelism.data_parallel_impl fsdp2 --model.converters float8 --float8.filter_fqns output "
        "--float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp",
        "simplefsdp_eager": "--parallelism.data_parallel_impl simple_fsdp",
        "simplefsdp_none": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing none",
        "simplefsdp_manual": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing manual",
        "simplefsdp_auto": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing auto",
        "simplefsdp_block": f"{SIMPLE_FSDP_COMPILED} --compile.bucketing block",
    }.items()
}
BASELINE = "fsdp2_eager"
ONE_RANK_VARIANTS = ("fsdp2_eager", "fsdp2_early_step", "fsdp2_compile", "simplefsdp_auto", "simplefsdp_block")
# Name -> the run's flags: float32, bf16 mixed precision (float32 weights), pure bf16 (training.dtype).
PRECISIONS = {
    "fp32": ["--training.mixed_precision_param", "float32"],
    "bf16": ["--training.mixed_precision_param", "bfloat16"],
    "bf16_pure": ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"],
}
DEPTH_VARIANTS = ("fsdp2_compile", "simplefsdp_block", "simplefsdp_manual", "simplefsdp_auto")


@dataclass(frozen=True)
class RunSpec:
    """One launch: a model, a variant, a precision, a number of ranks; for the compile-time table a
    depth and the Inductor cache folder its cold and warm launches share."""

    model: str
    variant: str
    precision: str
    nproc: int
    round: int = 0
    n_layers: int | None = None
    cache_dir: str | None = None
    side_by_side: int = 1  # launches of this run at once (the scaling ceiling)
    interleaved: tuple[str, ...] = ()  # the variants whose steps alternate in this launch (--interleave)

    @property
    def label(self) -> str:
        depth = f"_{self.n_layers}layers" if self.n_layers else ""
        ranks = f"{self.nproc}rank" + (f"x{self.side_by_side}" if self.side_by_side > 1 else "")
        return f"{self.model}{depth}_{self.precision}_{ranks}_{self.variant}_r{self.round}"


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated flavors (default: {','.join(DEFAULT_SHAPES)})")
    parser.add_argument("--variants", help=f"comma-separated, from: {','.join(VARIANTS)} (default: all)")
    parser.add_argument(
        "--manual-plan",
        action="append",
        default=[],
        metavar="NAME=BUCKETS",
        help="one more variant, simplefsdp_manual_NAME: compiled SimpleFSDP with --compile.manual_buckets "
        "BUCKETS (repeatable), e.g. one='*' or tail='layers.[1-9]*+norm+output'",
    )
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
    parser.add_argument(
        "--precisions",
        help="comma-separated, from: fp32, bf16, bf16_pure (default: fp32,bf16, with --quick fp32; the compile-time table: fp32 only)",
    )
    parser.add_argument(
        "--ranks", help="comma-separated rank counts (1: ONE_RANK_VARIANTS only; default 1,2, with --quick 2)"
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="with --ranks 1,N: also N 1-rank runs launched at once, independent: the scaling the machine allows",
    )
    parser.add_argument("--rounds", type=int, help="times every run is repeated (default 3, with --quick 1)")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help=f"one launch per model, precision and ranks, the variants' steps alternating: ratios to {BASELINE} "
        "step by step, under the same load (no memory or collectives)",
    )
    parser.add_argument("--compile-depths", help="comma-separated layer counts: the compile-time table instead")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one variant may take (default 1800)")
    parser.add_argument(
        "--out", help="result JSON (default bench/results/dp_compare.json, dp_compare_quick.json with --quick)"
    )
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)

    models = args.models.split(",") if args.models else (QUICK_MODELS if args.quick else list(DEFAULT_SHAPES))
    args.variant_flags, variants = choose_variants(args, parser)
    # Checked here rather than by the workers, so that a typo does not surface minutes into a run.
    unknown_models = [m for m in models if m not in llama3_flavors]
    if unknown_models:
        parser.error(f"unknown models {unknown_models}; known: {', '.join(llama3_flavors)}")
    args.models, args.variants = models, variants
    args.warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else DEFAULT_WARMUP)
    args.steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first step compiles)")
    for name in ("seq_len", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    args.compile_depths = [int(n) for n in args.compile_depths.split(",")] if args.compile_depths else None
    if args.compile_depths and args.precisions not in (None, "fp32"):
        parser.error("--precisions: the compile-time table (--compile-depths) is measured in fp32 only")
    args.precisions = (args.precisions or ("fp32" if args.quick else "fp32,bf16")).split(",")
    if any(p not in PRECISIONS for p in args.precisions):
        parser.error(f"--precisions: choose from {', '.join(PRECISIONS)}")
    args.ranks = [int(n) for n in (args.ranks or ("2" if args.quick else "1,2")).split(",")]
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if args.ceiling and (1 not in args.ranks or max(args.ranks) < 2):
        parser.error("--ceiling compares 1-rank runs alone and side by side: give --ranks 1,N")
    if args.interleave and (args.compile_depths or args.ceiling):
        parser.error(
            "--interleave measures steps of several variants in one launch: not with --compile-depths or --ceiling"
        )
    if args.interleave and (BASELINE not in variants or len(variants) < 2):
        parser.error(f"--interleave: --variants must hold {BASELINE} and at least one other")
    name = (
        "dp_compare_depth.json"
        if args.compile_depths
        else "dp_compare_quick.json"
        if args.quick
        else "dp_compare_interleaved.json"
        if args.interleave
        else "dp_compare.json"
    )
    args.out = args.out or os.path.join(RESULTS_DIR, name)
    return args


def choose_variants(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[dict[str, list[str]], list[str]]:
    """Every variant's flags (the fixed ones and the manual plans asked for) and the variants to run."""
    flags = dict(VARIANTS)
    for plan in args.manual_plan:
        name, _, buckets = plan.partition("=")
        if not (name.isidentifier() and buckets):
            parser.error(f"--manual-plan {plan!r}: expected NAME=BUCKETS, e.g. one='*'")
        compiled_manual = f"{SIMPLE_FSDP_COMPILED} --compile.bucketing manual".split()
        flags[f"simplefsdp_manual_{name}"] = [*compiled_manual, "--compile.manual_buckets", buckets]
    chosen = args.variants.split(",") if args.variants else list(flags)
    unknown = [v for v in chosen if v not in flags]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(flags)}")
    return flags, chosen


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


def run_variant(spec: RunSpec, shape: Shape, args: argparse.Namespace, log_path: str) -> dict[str, Any]:
    """Launches one run (``spec.side_by_side`` identical launches at once) and returns the worker's
    result, side by side the first launch's with tokens/s averaged over all. Raises RuntimeError
    when a launch fails and subprocess.TimeoutExpired after ``--timeout`` seconds (all are killed)."""
    # The warm-up stays within the shortest run's step count (the base config warms up over 6 steps).
    overrides = [
        *f"--model.flavor {spec.model} --training.seq_len {shape.seq_len} --training.local_batch_size {shape.batch_size}"
        f" --lr_scheduler.warmup_steps {min(6, args.warmup + args.steps)}".split(),
        *PRECISIONS[spec.precision],
        *(["--model.n_layers", str(spec.n_layers)] if spec.n_layers else []),
        *([] if spec.interleaved else args.variant_flags[spec.variant]),
    ]
    alternated = [f"--interleave={v}={' '.join(args.variant_flags[v])}" for v in spec.interleaved]
    with tempfile.TemporaryDirectory(prefix="dp_compare_") as tmp:
        if spec.cache_dir:
            # The compile-time table: torch's own caches on, in a folder the cold and warm launches
            # share, and one dump folder, as a restart of the same job has (SimpleFSDP's saved plan).
            caches = dict(TORCHINDUCTOR_CACHE_DIR=spec.cache_dir)
            overrides += ["--job.dump_folder", os.path.join(spec.cache_dir, "dump")]
        else:
            # The FX graph cache would skip the bucketing pass on a hit (no graph reports), and a
            # fresh Inductor cache per launch makes every variant pay its own full (cold) compile.
            caches = dict(
                TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                TORCHINDUCTOR_AUTOGRAD_CACHE="0",
                TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
            )
        # Compile in the rank's own process: the cores already run the ranks.
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, TORCHINDUCTOR_COMPILE_THREADS="1", **caches)
        torchrun = f"-m torch.distributed.run --standalone --nproc-per-node={spec.nproc} {WORKER}"
        # Each launch in a folder of its own: the worker's dump folder (SimpleFSDP's saved plan).
        outs = [os.path.join(tmp, f"launch{i}", "result.json") for i in range(spec.side_by_side)]
        for out in outs:
            os.makedirs(os.path.dirname(out))
        logs = [log_path] + [f"{log_path}.{i}" for i in range(1, spec.side_by_side)]
        commands = [
            [sys.executable, *torchrun.split(), *f"--out {out} --warmup {args.warmup} --steps {args.steps}".split()]
            + alternated
            + ["--", *overrides]
            for out in outs
        ]
        returncodes = launch_together(commands, logs, env, args.timeout)
        results = []
        for out, log, returncode in zip(outs, logs, returncodes, strict=True):
            if returncode != 0 or not os.path.exists(out):
                cause = first_traceback(log).splitlines()[-1:] or [""]
                raise RuntimeError(f"torchrun exited with code {returncode}: {cause[0].strip()}")
            with open(out) as f:
                results.append(json.load(f))
    result = results[0]
    if spec.side_by_side > 1:
        result["side_by_side_tps"] = [r["tps_per_rank"] for r in results]
        result["tps_per_rank"] = statistics.mean(result["side_by_side_tps"])
    result["overrides"] = overrides
    return result


def launch_together(commands: list[list[str]], logs: list[str], env: dict[str, str], timeout: float) -> list[int]:
    """Starts every command at once, each writing to its log, and returns their exit codes.
    Raises subprocess.TimeoutExpired after ``timeout`` seconds, with every launch stopped."""
    processes = []
    try:
        for command, log in zip(commands, logs, strict=True):
            with open(log, "w") as f:
                f.write(" ".join(command) + "\n\n")
                f.flush()
                processes.append(
                    subprocess.Popen(
                        command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(0.0, deadline - time.monotonic())) for p in processes]
    except BaseException:
        for process in processes:
            stop_launch(process)
        raise


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


def summarize_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, precision, variant, ranks, side by side): the first round's collectives
    and memory, and over the rounds the median and spread of tokens/s per rank, of its ratio to the
    same round's FSDP2 eager run, and the scaling efficiency against the same variant on 1 rank
    alone (for 1-rank runs side by side: the machine's ceiling for it)."""
    done = {
        (r["model"], r["precision"], r["variant"], r["nproc"], r["side_by_side"], r["round"]): r
        for r in results
        if r["ok"]
    }
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["model"], r["precision"], r["variant"], r["nproc"], r["side_by_side"]), []).append(r)
    rows = []
    for (model, precision, variant, nproc, side_by_side), runs in groups.items():
        ok = [r for r in runs if r["ok"]]
        row: dict[str, Any] = {
            "model": model,
            "precision": precision,
            "variant": variant,
            "nproc": nproc,
            "side_by_side": side_by_side,
        }
        if not ok:
            rows.append(row | {"ok": False, "error": runs[0]["error"]})
            continue
        baselines = [done.get((model, precision, BASELINE, nproc, side_by_side, r["round"])) for r in ok]
        paired = [(r, base) for r, base in zip(ok, baselines, strict=True) if base is not None]
        one_rank = [done[key] for r in ok if (key := (model, precision, variant, 1, 1, r["round"])) in done]
        tps = [r["tps_per_rank"] for r in ok]
        ratios = [r["tps_per_rank"] / base["tps_per_rank"] for r, base in paired]
        memory = [r["memory"]["tracked_peak_bytes"] / b["memory"]["tracked_peak_bytes"] for r, b in paired]
        rows.append(
            {k: v for k, v in ok[0].items() if k not in ("round", "tps_per_rank", "compile_s")}
            | row
            | {
                "ok": True,
                "rounds": len(ok),
                "tps_per_rank": _spread(tps),
                "tps_ratio": _spread(ratios) if ratios else None,
                "memory_ratio": statistics.median(memory) if memory else None,
                "scaling": statistics.median(tps) / statistics.median(r["tps_per_rank"] for r in one_rank)
                if nproc * side_by_side > 1 and one_rank
                else None,
                "compile_s": statistics.median(r["compile_s"] for r in ok),
                "cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in ok),
            }
        )
    return rows


def summarize_interleaved(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, precision, ranks, variant) of the --interleave launches: tokens/s per
    rank over the rounds (median, spread), each step's time over the baseline's step next to it in
    the same launch, over all rounds (median, quartiles), and the scaling against 1 rank."""
    variants: dict[tuple, list[dict[str, Any]]] = {}
    for launch in results:
        key = (launch["model"], launch["precision"], launch["nproc"])
        for variant in launch["interleaved"]:
            variants.setdefault((*key, variant), []).append(launch)
    rows = []
    for (model, precision, nproc, variant), launches in variants.items():
        row: dict[str, Any] = {"model": model, "precision": precision, "nproc": nproc, "variant": variant}
        ok = [launch for launch in launches if launch["ok"]]
        if not ok:
            rows.append(row | {"ok": False, "error": launches[0]["error"]})
            continue
        mine = [launch["per_variant"][variant] for launch in ok]
        base = [launch["per_variant"][BASELINE] for launch in ok]
        step_ratios = [
            b / m
            for r, br in zip(mine, base, strict=True)
            for m, b in zip(r["step_times_s"], br["step_times_s"], strict=True)
        ]
        one_rank = [
            launch["per_variant"][variant]["tps_per_rank"]
            for launch in results
            if launch["ok"]
            and launch["nproc"] == 1
            and (launch["model"], launch["precision"]) == (model, precision)
            and variant in launch["interleaved"]
        ]
        tps = [r["tps_per_rank"] for r in mine]
        quartiles = statistics.quantiles(step_ratios, n=4) if len(step_ratios) > 1 else step_ratios * 3
        rows.append(
            row
            | {
                "ok": True,
                "rounds": len(ok),
                "tps_per_rank": _spread(tps),
                "tps_ratio": _spread([r["tps_per_rank"] / b["tps_per_rank"] for r, b in zip(mine, base, strict=True)]),
                "step_ratio": {
                    "median": quartiles[1],
                    "q1": quartiles[0],
                    "q3": quartiles[2],
                    "steps": len(step_ratios),
                },
                "scaling": statistics.median(tps) / statistics.median(one_rank) if nproc > 1 and one_rank else None,
                "final_loss": mine[0]["final_loss"],
            }
        )
    return rows


def format_interleaved_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'model':<16} {'prec':<9} {'ranks':>5} {'variant':<18} {'tok/s/rank [min-max]':>22} "
        f"{'x tps [min-max]':>19} {'x step [q1-q3]':>19} {'steps':>5} {'scale':>5} {'loss':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        name = f"{r['model']:<16} {r['precision']:<9} {r['nproc']:>5} {r['variant']:<18}"
        if not r["ok"]:
            lines.append(f"{name} FAILED: {r['error']}")
            continue
        step = r["step_ratio"]
        step_text = f"{step['median']:.2f} [{step['q1']:.2f}-{step['q3']:.2f}]"
        lines.append(
            f"{name} {_with_spread(r['tps_per_rank'], '.0f'):>22} {_with_spread(r['tps_ratio'], '.2f'):>19} "
            f"{step_text:>19} {step['steps']:>5} {_ratio(r['scaling'])} {r['final_loss']:>7.4f}"
        )
    return "\n".join(lines)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def graph_note(r: dict[str, Any]) -> str | None:
    """Compiled SimpleFSDP: the collectives the bucketing pass left in the graphs, checked against
    the collectives the profiled step actually issued."""
    reports = r.get("graph_reports")
    if not r["ok"] or not reports:
        return None
    if len(reports) < 2:
        return f"{r['model']} {r['variant']}: only {len(reports)} graph compiled, expected forward and backward"
    forward, backward = reports[-2]["collectives"], reports[-1]["collectives"]
    recompiled = f"; {len(reports)} graphs compiled (recompilation)" if len(reports) > 2 else ""
    if r["variant"] == "simplefsdp_block":
        # One block's graphs, run for every block; the rest of the model gathers eagerly.
        return (
            f"{r['model']} {r['variant']}: one block graph, fw AG {forward.get('all_gather', 0)} "
            f"BC {forward.get('broadcast', 0)}, bw AG {backward.get('all_gather', 0)} "
            f"BC {backward.get('broadcast', 0)} RS {backward.get('reduce_scatter', 0)}{recompiled}"
        )
    in_graphs = {
        k: forward.get(k, 0) + backward.get(k, 0)
        for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
    }
    runtime = r["collectives"]
    agrees = all(in_graphs[k] == runtime.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"))
    buckets = "per-parameter" if r["buckets"] is None else f"{len(r['buckets'])} buckets"
    note = (
        f"{r['model']} {r['variant']}: {buckets}; graphs fw AG {forward.get('all_gather', 0)} "
        f"BC {forward.get('broadcast', 0)}, bw AG {backward.get('all_gather', 0)} "
        f"BC {backward.get('broadcast', 0)} RS {backward.get('reduce_scatter', 0)} "
        f"A2A {backward.get('all_to_all', 0)} AR {in_graphs['all_reduce']}; "
        + ("matches the profiled step" if agrees else "DIFFERS from the profiled step (AG/BC/RS/A2A)")
    )
    return note + recompiled


def _ratio(value: float | None) -> str:
    return f"{value:5.2f}" if value is not None else f"{'-':>5}"


def _with_spread(spread: dict[str, float] | None, fmt: str) -> str:
    if spread is None:
        return "-"
    return f"{spread['median']:{fmt}} [{spread['min']:{fmt}}-{spread['max']:{fmt}}]"


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'model':<16} {'prec':<9} {'ranks':>5} {'variant':<18} {'tok/s/rank [min-max]':>22} "
        f"{'x tps [min-max]':>19} {'scale':>5} {'step s':>6} {'CPU s':>6} {'mem MiB':>8} {'x mem':>5} {'AG':>4} {'BC':>4} {'RS':>4} {'AR':>4} "
        f"{'A2A':>4} "
        f"{'wire MiB':>8} {'theory':>9} {'compile s':>9} {'loss':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        ranks = f"{r['nproc']}x{r['side_by_side']}" if r["side_by_side"] > 1 else str(r["nproc"])
        name = f"{r['model']:<16} {r['precision']:<9} {ranks:>5} {r['variant']:<18}"
        if not r["ok"]:
            lines.append(f"{name} FAILED: {r['error']}")
            continue
        c = r["collectives"]
        lines.append(
            f"{name} {_with_spread(r['tps_per_rank'], '.0f'):>22} {_with_spread(r['tps_ratio'], '.2f'):>19} "
            f"{_ratio(r['scaling'])} {r['tokens_per_rank_per_step'] / r['tps_per_rank']['median']:>6.2f} "
            f"{r['cpu_s_per_step']:>6.2f} {r['memory']['tracked_peak_bytes'] / MIB:>8.1f} {_ratio(r['memory_ratio'])} "
            f"{c['all_gather']:>4} {c.get('broadcast', 0):>4} {c['reduce_scatter']:>4} {c['all_reduce']:>4} "
            f"{c.get('all_to_all', 0):>4} "
            f"{r['wire_bytes_estimate'] / MIB:>8.1f} {r['theory_bytes'] / MIB:>9.1f} "
            f"{r['compile_s']:>9.1f} {r['final_loss']:>7.4f}"
        )
    return "\n".join(lines)


def format_depth_table(results: list[dict[str, Any]]) -> str:
    """Compile seconds per depth: each variant cold and on warm caches (and warm over cold), and
    each SimpleFSDP variant's cold compile over FSDP2's."""
    seconds = {(r["n_layers"], r["variant"], r["round"]): r["compile_s"] for r in results if r["ok"]}
    variants = [v for v in DEPTH_VARIANTS if any(r["variant"] == v for r in results)]
    header = f"{'layers':>6} " + " ".join(f"{v + ' cold':>22} {'warm':>6} {'w/c':>5}" for v in variants)
    baseline = DEPTH_VARIANTS[0]
    others = [v for v in variants if v != baseline]
    header += "".join(f" {v + '/' + baseline:>32}" for v in others)
    lines = [header, "-" * len(header)]
    for depth in sorted({r["n_layers"] for r in results}):
        cells = []
        for v in variants:
            cold, warm = (seconds.get((depth, v, i)) for i in (0, 1))
            text = [f"{t:.1f}" if t is not None else "failed" for t in (cold, warm)]
            cells.append(f"{text[0]:>22} {text[1]:>6} {_ratio(warm / cold if cold and warm is not None else None)}")
        base = seconds.get((depth, baseline, 0))
        for v in others:
            cold = seconds.get((depth, v, 0))
            cells.append(f"{_ratio(cold / base if cold and base else None):>32}")
        lines.append(f"{depth:>6} " + " ".join(cells))
    return "\n".join(lines)


LEGEND = f"""\
prec: fp32, bf16 mixed precision (fp32 weights and reduction), or bf16_pure (training.dtype bfloat16). ranks: 1 (no data parallelism), 2, 1x2 (--ceiling).
tok/s/rank: tokens per rank per second of the timed steps (the slowest rank's step time each step; data
  loading excluded), median over the rounds [min-max]. x tps: ratio to the same round's {BASELINE}
  (same model, precision and ranks), median [min-max]; x mem: the same for tracked memory (median).
scale: tok/s/rank on this many ranks over the same variant's on 1 rank (scaling efficiency); for 1xN
  (--ceiling), N independent 1-rank runs at once over one alone: what the machine allows.
step s: seconds per step at the median tok/s/rank. CPU s: CPU seconds per step a rank's process used,
  all threads (compute, and the backend's communication threads), median over rounds; below step s,
  the rank waited.
mem MiB: peak tracked tensor memory per rank (max over ranks), first round.
AG/RS/AR/A2A: all-gathers, reduce-scatters, all-reduces, all-to-alls one rank issues in one step
  (profiled step, ProcessGroup-level c10d ops: model, gradient clipping and loss all-reduce).
wire MiB: what a ring algorithm sends per rank for them: size x (N-1)/N, all-reduce twice that.
  theory: FSDP's wire MiB, (2 x P in the compute dtype + P in the reduce dtype) x (N-1)/N for P
  parameters (all-gather forward and backward, reduce-scatter gradients). On gloo a reduce-scatter
  is an all-reduce of its whole input underneath, so FSDP2's real gradient bytes are twice what
  this counts; compiled SimpleFSDP reduces with an all-to-all there, which sends the theory's bytes.
compile s: first step minus the median timed step, with a fresh Inductor cache per run (median over
  rounds): the compile for compiled variants, one-time set-up (lazy init, optimizer state) for eager ones.
loss: global loss at the last timed step, first round (same data and seed everywhere: the variants
  should agree)."""


INTERLEAVED_LEGEND = f"""\
--interleave: the variants of a row's model, precision and ranks ran in one launch per round, one
  step of each in turn (the order reversed every step, the ranks meeting at a barrier before each).
tok/s/rank: tokens per rank per second of the timed steps (the slowest rank's step time each step),
  median over the rounds [min-max]. x tps: over {BASELINE}'s in the same launch, median [min-max].
x step: {BASELINE}'s step time over this variant's step next to it, every timed step of every
  round: median [first-third quartile]. steps: how many. scale: tok/s/rank over the same variant's
  on 1 rank (--ranks 1,N). loss: at the last timed step, first round."""


def throughput_runs(args: argparse.Namespace) -> list[RunSpec]:
    """Every round's launches; within a round, each model's variants back to back (or, with
    --interleave, in one launch)."""
    if args.interleave:
        return [
            RunSpec(model, "interleaved", precision, nproc, round_index, interleaved=tuple(variants))
            for round_index in range(args.rounds)
            for model in args.models
            for precision in args.precisions
            for nproc in args.ranks
            if len(variants := [v for v in args.variants if nproc > 1 or v in ONE_RANK_VARIANTS]) > 1
        ]
    return [
        RunSpec(model, variant, precision, nproc, round_index, side_by_side=side_by_side)
        for round_index in range(args.rounds)
        for model in args.models
        for precision in args.precisions
        for nproc, side_by_side in launch_shapes(args)
        for variant in args.variants
        if nproc > 1 or variant in ONE_RANK_VARIANTS
    ]


def launch_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(ranks, launches side by side) of each round: every --ranks alone, with --ceiling also the
    largest rank count's worth of 1-rank launches at once."""
    shapes = [(nproc, 1) for nproc in args.ranks]
    return shapes + [(1, max(args.ranks))] if args.ceiling else shapes


def depth_runs(args: argparse.Namespace, cache_root: str) -> list[RunSpec]:
    """Per depth and variant: a cold launch (round 0) and a restart on its caches (round 1)."""
    return [
        RunSpec("debugmodel", variant, "fp32", 2, restart, depth, os.path.join(cache_root, f"{variant}_{depth}"))
        for depth in args.compile_depths
        for variant in DEPTH_VARIANTS
        if variant in args.variants
        for restart in (0, 1)
    ]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    log_dir = os.path.join(RESULTS_DIR, "dp_compare_logs")
    os.makedirs(log_dir, exist_ok=True)
    info = machine_info()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dp_compare_caches_") as cache_root:
        runs = depth_runs(args, cache_root) if args.compile_depths else throughput_runs(args)
        print(
            f"dp_compare: {len(runs)} launches, warm-up {args.warmup} + {args.steps} timed steps; "
            f"torch {info['torch']}, {info['usable_cores']} cores, load average {info['loadavg_start'][0]:.1f}",
            flush=True,
        )
        results = run_all(runs, args, log_dir)
    info["loadavg_end"] = os.getloadavg()
    info["total_wall_s"] = time.perf_counter() - start
    if args.compile_depths:
        rows, table = [], format_depth_table(results)
    elif args.interleave:
        rows = summarize_interleaved(results)
        table = format_interleaved_table(rows)
    else:
        rows = summarize_runs(results)
        table = format_table(rows)
    write_results(args, info, results, rows)
    print()
    print(table)
    notes = [n for r in rows if (n := graph_note(r))]
    if notes:
        print("\nCompiled SimpleFSDP graphs (BucketingPass reports):\n  " + "\n  ".join(notes))
    if args.interleave:
        print(f"\n{INTERLEAVED_LEGEND}")
    elif not args.compile_depths:
        print(f"\n{LEGEND}\nMemory: {MEMORY_METHOD}")
    print(f"\nTotal {info['total_wall_s'] / 60:.1f} min; results in {os.path.relpath(args.out, REPO)}")

    failed = [r for r in results if not r["ok"]]
    for r in failed:
        traceback = first_traceback(os.path.join(REPO, r["log"]))
        print(f"\nFAILED {r['label']}: {r['error']}\nfrom {r['log']}:\n{traceback}", file=sys.stderr)
    if failed:
        print(f"error: {len(failed)} of {len(results)} runs failed", file=sys.stderr)
        return 1
    return 0


def run_all(runs: list[RunSpec], args: argparse.Namespace, log_dir: str) -> list[dict[str, Any]]:
    """Every launch, one after the other; a failed one is recorded and skipped."""
    results: list[dict[str, Any]] = []
    for i, spec in enumerate(runs, 1):
        shape = model_shape(spec.model, args)
        log_path = os.path.join(log_dir, f"{spec.label}.log")
        print(f"[{i}/{len(runs)}] {spec.label} (seq_len {shape.seq_len}, batch {shape.batch_size}/rank) ... ", end="")
        sys.stdout.flush()
        run_start = time.perf_counter()
        entry: dict[str, Any] = asdict(spec) | {"label": spec.label, "log": os.path.relpath(log_path, REPO)}
        try:
            entry |= run_variant(spec, shape, args, log_path)
            entry |= {"ok": True, "error": None}
            rates = {v: r["tps_per_rank"] for v, r in entry["per_variant"].items()} if spec.interleaved else {}
            rate = ", ".join(f"{v} {tps:.0f}" for v, tps in rates.items()) or f"{entry['tps_per_rank']:.0f}"
            print(f"{time.perf_counter() - run_start:.0f} s, {rate} tok/s/rank", flush=True)
        except subprocess.TimeoutExpired:
            entry |= {"ok": False, "error": f"timed out after {args.timeout:.0f} s (--timeout)"}
            print(f"FAILED ({entry['error']}), see {entry['log']}", flush=True)
        except RuntimeError as e:
            entry |= {"ok": False, "error": str(e)}
            print(f"FAILED ({e}), see {entry['log']}", flush=True)
        entry["wall_s"] = time.perf_counter() - run_start
        results.append(entry)
    return results


def write_results(
    args: argparse.Namespace, info: dict[str, Any], results: list[dict[str, Any]], rows: list[dict[str, Any]]
) -> None:
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
                    "precisions": args.precisions,
                    "ranks": args.ranks,
                    "ceiling": args.ceiling,
                    "rounds": args.rounds,
                    "compile_depths": args.compile_depths,
                    "interleave": args.interleave,
                },
                "memory_method": MEMORY_METHOD,
                "variants": {v: args.variant_flags[v] for v in args.variants},
                "rows": rows,
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
