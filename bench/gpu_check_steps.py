"""The GPU check's plan (bench/gpu_check.py runs it): its steps in order, the sizes they train at on
a GPU and in a CPU rehearsal, and how each reads its results. Every step launches processes (train.py,
pytest, the dry run, bench/gpu_check_worker.py) and returns one Row; nothing here imports torch."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join("bench", "gpu_check_worker.py")
FIRST_TIMED_STEP = 3  # the first steps compile and warm up: tokens/s is the median from this step on
# Losses against train.py's eager run, relative, at every step. Eager runs do the same arithmetic on
# one rank (CUDA kernels with atomics drift at the last bits; test_cuda.py allows 1e-4 across
# layouts); compiled ones fuse and reorder float32 sums, which 20 Adam steps amplify.
EAGER_RTOL, COMPILED_RTOL = 1e-4, 1e-3
# Link figures for auto bucketing: one rank has no traffic to time (an H100 node's, as in
# bench/dry_run_sizes.py).
AUTO_LINK = ["--comm.alpha_us", "10", "--comm.bandwidth_gbps", "450"]
# Every Tessera run: the debug config's corpus and tokenizer, logged every step, no TensorBoard.
BASE_OPTIONS = "--job.config_file configs/debug_model.toml --metrics.log_freq 1 --metrics.enable_tensorboard false"
WIDE_OPTIONS = "--training.mixed_precision_param bfloat16 --activation_checkpoint.mode full --compile.enable"
# torchtitan's dependencies, and triton, which its MoE kernels import whatever the model (CUDA builds
# of torch bring it).
TITAN_MODULES = ("torchdata", "datasets", "tokenizers", "fsspec", "tyro", "tensorboard", "einops", "PIL", "triton")
TITAN_STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)"
    r"(?:.*?tflops:\s*([\d.,]+).*?mfu:\s*([\d.]+)%)?"
)
TITAN_FLAVOR = "gpu_check_8b"  # the 8B-wide size, registered in torchtitan under this name
EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception)\b.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?)\b")
DRY_RUN_PEAK = re.compile(r"peak memory per rank ([\d.]+) (GiB|MiB)")


@dataclass(frozen=True)
class Sizes:
    """What the runs train: the debug model (parity, checkpoints) and the 8B-wide job."""

    debug: tuple[str, ...]  # options beside configs/debug_model.toml
    wide_model: dict[str, int]  # [model] fields over the 8B flavor
    wide: tuple[str, ...]  # the 8B-wide job's training options
    checkpoint_steps: tuple[int, int, int]  # first launch's steps, interval, second launch's steps
    float8: tuple[str, ...] = ()  # beside --model.converters float8


GPU_SIZES = Sizes(
    debug=("--training.steps", "20"),
    wide_model={"n_layers": 4, "vocab_size": 128256},
    wide=("--training.seq_len", "8192", "--training.local_batch_size", "1", "--training.steps", "8"),
    checkpoint_steps=(10, 5, 15),
)
# CPU rehearsal: the same options at toy sizes (float8 emulated: torch's CPU float8 kernel is slow).
REHEARSAL_SIZES = Sizes(
    debug=("--model.n_layers", "2", "--training.seq_len", "64", "--training.steps", "6"),
    wide_model={"n_layers": 1, "dim": 256, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 64, "vocab_size": 4096},
    wide=("--training.seq_len", "128", "--training.local_batch_size", "1", "--training.steps", "4"),
    checkpoint_steps=(4, 2, 6),
    float8=("--float8.emulate",),
)


@dataclass
class Row:
    """One line of the table."""

    step: str
    status: str  # pass, fail or skip
    seconds: float = 0.0
    tps: float | None = None  # tokens/s per GPU
    tflops: float | None = None
    mfu: float | None = None  # percent
    peak_gib: float | None = None
    estimate_gib: float | None = None  # the dry run's
    note: str = ""


@dataclass
class Context:
    """What the steps share: where to write, how to launch, what the machine has."""

    out: str
    python: str
    env: dict[str, str]
    sizes: Sizes
    machine: dict[str, Any]
    rehearse: bool = False
    titan_site: str | None = None  # where torchtitan is installed
    titan_launcher: str | None = None  # rehearsal: torchtitan's CPU launcher
    titan_skip: str = "no --torchtitan-wheel given"  # why the torchtitan step skips, or ""
    step_deadline: float = math.inf  # time.monotonic() when the running step is out of time
    results: dict[str, Any] = field(default_factory=dict)  # what a step leaves for later ones
    running: list[Launch] = field(default_factory=list)  # launches not waited for yet

    def dump(self, name: str) -> str:
        """A run's dump folder, emptied: Tessera appends to an existing metrics.jsonl."""
        folder = os.path.join(self.out, "runs", name)
        shutil.rmtree(folder, ignore_errors=True)
        return folder


class Launch:
    """One process of a step, its output appended to the step's log, in a session of its own so that
    a timeout stops it with its children (torchrun's ranks, Inductor's compile workers)."""

    def __init__(self, ctx: Context, log_name: str, argv: list[str], env: dict[str, str] | None = None):
        self.log_path = os.path.join(ctx.out, "logs", f"{log_name}.log")
        self.deadline, self.running = ctx.step_deadline, ctx.running
        with open(self.log_path, "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            self.start = time.monotonic()
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=env or ctx.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.running.append(self)
        self.returncode: int | None = None
        self.timed_out = False

    def wait(self) -> Launch:
        try:
            self.returncode = self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.stop()
        except BaseException:  # the check itself is interrupted: what it started must not outlive it
            self.stop()
            raise
        finally:
            self.running.remove(self)
        return self

    def stop(self) -> None:
        """Ends the launch's whole session: SIGTERM, up to 10 s to end, then SIGKILL for what is left."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.returncode = self.process.wait(timeout=10)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def failure(self) -> str:
        """Why it failed, in a few words: the timeout, else the first exception the log shows (the
        cause: torchrun's summary comes after it), else its last line that speaks of an error."""
        if self.timed_out:
            return f"timed out after {time.monotonic() - self.start:.0f} s"
        lines = [line.strip() for line in self.text().splitlines() if line.strip()]
        raised = [m.group(1) for line in lines if (m := EXCEPTION_LINE.match(line)) and "ChildFailed" not in line]
        errors = [line for line in lines if re.search(r"\berror\b", line, re.I)]
        return f"exit {self.returncode}: {(raised[:1] or errors[-1:] or lines[-1:] or [''])[0][:200]}"


def run(ctx: Context, log_name: str, argv: list[str], env: dict[str, str] | None = None) -> Launch:
    return Launch(ctx, log_name, argv, env).wait()


def read_metrics(dump: str) -> list[dict[str, Any]]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _median(values: list[Any]) -> float | None:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def figures(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """tokens/s, TFLOP/s, MFU: medians from FIRST_TIMED_STEP on (else the last step); peak GiB: the max."""
    timed = [r for r in records if r["step"] >= FIRST_TIMED_STEP] or records[-1:]
    peak = [r["memory_gib"] for r in records if "memory_gib" in r]
    return {
        "tps": _median([r.get("tps") for r in timed]),
        "tflops": _median([r.get("tflops") for r in timed]),
        "mfu": _median([r.get("mfu") for r in timed]),
        "peak_gib": max(peak) if peak else None,
    }


def loss_gap(losses: dict[int, float], reference: dict[int, float]) -> float | None:
    """The largest relative difference of the steps both have, or None when they share none."""
    shared = sorted(losses.keys() & reference.keys())
    if not shared:
        return None
    return max(abs(losses[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in shared)


def debug_options(ctx: Context, dump: str, *extra: str) -> list[str]:
    """The debug model in float32 (parity needs it), logged every step, no TensorBoard."""
    float32 = ["--training.mixed_precision_param", "float32"]
    return [*BASE_OPTIONS.split(), *float32, *ctx.sizes.debug, *extra, "--job.dump_folder", dump]


def wide_options(ctx: Context, dump: str, *extra: str) -> list[str]:
    """The 8B-wide job: bf16, full activation checkpointing, compiled, on the default corpus."""
    model = [item for name, value in ctx.sizes.wide_model.items() for item in (f"--model.{name}", str(value))]
    job = [*WIDE_OPTIONS.split(), "--lr_scheduler.warmup_steps", "2", *extra, "--job.dump_folder", dump]
    return [*BASE_OPTIONS.split(), "--model.flavor", "8B", *model, *ctx.sizes.wide, *job]


def _measured(launch: Launch, dump: str, what: str) -> Row:
    """A training launch's row: fail unless it exited 0 and logged steps; the figures of its metrics."""
    records = read_metrics(dump)
    if not launch.ok or not records:
        return Row("", "fail", note=launch.failure() if not launch.ok else f"no steps in {dump}/metrics.jsonl")
    first, last = records[0], records[-1]
    note = f"{what}; loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']})"
    return Row("", "pass", note=note, **figures(records))


def _compare(row: Row, ctx: Context, dump: str, rtol: float) -> Row:
    """Fails ``row`` when its losses leave train_eager's by more than ``rtol``; says the gap either way."""
    reference = ctx.results.get("train_eager")
    if row.status != "pass":
        return row
    if reference is None:
        row.note += "; losses not compared (train_eager did not pass)"
        return row
    gap = loss_gap({r["step"]: r["loss"] for r in read_metrics(dump)}, reference)
    if gap is None or gap > rtol:
        row.status = "fail"
    row.note += f"; max loss gap to train_eager {gap:.1e} (tolerance {rtol:.0e})" if gap is not None else ""
    return row


def pytest_outcome(text: str, returncode: int | None) -> tuple[str, str]:
    """(status, note) of a pytest run: its summary line, the first skip's reason, the failed tests' names.
    Every test skipped (no CUDA) is a skip."""
    summaries = [line.strip("= ") for line in text.splitlines() if PYTEST_COUNTS.search(line)]
    summary = summaries[-1] if summaries else ""
    counts = {kind: int(n) for n, kind in PYTEST_COUNTS.findall(summary)}
    reason = re.search(r"^SKIPPED \[\d+\] [^:]+(?::\d+)?: (.*)$", text, re.M)
    if returncode == 0 and counts.get("skipped") and reason:
        summary += f" ({reason.group(1)})"
    if returncode == 0:
        return ("pass" if counts.get("passed") else "skip"), summary
    failed = re.findall(r"^(?:FAILED|ERROR) \S+::(\S+)", text, re.M)
    return "fail", summary + (f": {', '.join(failed)}" if failed else "")


def step_test_cuda(ctx: Context) -> Row:
    if not ctx.machine.get("pytest"):
        return Row("", "skip", note="pytest is not installed (give its wheel with --wheels)")
    env = dict(ctx.env, TESSERA_TEST_CACHE_DIR=ctx.env["TESSERA_CACHE_DIR"])
    argv = [ctx.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "tests/distributed/test_cuda.py"]
    launch = run(ctx, "test_cuda", argv, env)
    status, note = pytest_outcome(launch.text(), launch.returncode)
    return Row("", status, note=note if note and not launch.timed_out else launch.failure())


def _train(ctx: Context, name: str, what: str, *options: str) -> Row:
    dump = ctx.dump(name)
    row = _measured(run(ctx, name, [ctx.python, "train.py", *debug_options(ctx, dump, *options)]), dump, what)
    if name == "train_eager" and row.status == "pass":
        ctx.results["train_eager"] = {r["step"]: r["loss"] for r in read_metrics(dump)}
        return row
    return _compare(row, ctx, dump, COMPILED_RTOL)


def step_train_eager(ctx: Context) -> Row:
    return _train(ctx, "train_eager", "train.py, debug model, float32, eager")


def step_train_compiled(ctx: Context) -> Row:
    return _train(ctx, "train_compiled", "train.py --compile.enable", "--compile.enable")


def _one_rank(ctx: Context, name: str, what: str, rtol: float, *options: str) -> Row:
    """The debug model under a data parallelism on a one-rank mesh (bench/gpu_check_worker.py dp)."""
    dump = ctx.dump(name)
    launch = run(ctx, name, [ctx.python, WORKER, "dp", *debug_options(ctx, dump, *options)])
    row = _compare(_measured(launch, dump, what), ctx, dump, rtol)
    reports = [json.loads(line[len("REPORT ") :]) for line in launch.text().splitlines() if line.startswith("REPORT ")]
    if not reports:
        return row
    report = reports[-1]
    row.note += f"; {report['model_class']} with {report['parameter_class']} parameters"
    if report["graphs"] is not None and report["data_parallel_collectives"]:
        row.note += f"; {report['data_parallel_collectives']} data-parallel collectives in the compiled graphs"
    elif report["graphs"] is not None:
        row.note += "; no collective in the compiled graphs (DTensor traces none on a one-rank mesh: nothing to bucket)"
    return row


def step_fsdp2_eager(ctx: Context) -> Row:
    return _one_rank(ctx, "fsdp2_eager", "FSDP2 on a one-rank mesh, eager", EAGER_RTOL)


def step_fsdp2_compiled(ctx: Context) -> Row:
    return _one_rank(ctx, "fsdp2_compiled", "FSDP2 on a one-rank mesh, compiled", COMPILED_RTOL, "--compile.enable")


def step_simple_fsdp_auto(ctx: Context) -> Row:
    options = ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.bucketing", "auto"]
    what = "SimpleFSDP, auto buckets (link figures given: one rank has no traffic to time)"
    return _one_rank(ctx, "simple_fsdp_auto", what, COMPILED_RTOL, *options, *AUTO_LINK)


def step_simple_fsdp_block(ctx: Context) -> Row:
    options = ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.bucketing", "block"]
    return _one_rank(ctx, "simple_fsdp_block", "SimpleFSDP, block buckets", COMPILED_RTOL, *options)


def dry_run_estimate(text: str) -> float | None:
    """The dry run's peak per rank in GiB, from its summary."""
    found = DRY_RUN_PEAK.search(text)
    if found is None:
        return None
    return float(found.group(1)) / (1024 if found.group(2) == "MiB" else 1)


def _wide_what(ctx: Context, extra: str = "") -> str:
    model = ", ".join(f"{k} {v}" for k, v in ctx.sizes.wide_model.items())
    seq = ctx.sizes.wide[ctx.sizes.wide.index("--training.seq_len") + 1]
    return f"8B flavor with {model}, seq {seq}, bf16, full AC, compiled{extra}"


def step_wide_bf16(ctx: Context) -> Row:
    """The training launch and, on the CPU beside it, the dry run of the same job."""
    dump = ctx.dump("wide_bf16")
    dry_dump = ctx.dump("wide_bf16_dry_run")
    dry_run_argv = [ctx.python, "-m", "programs.dry_run", "--world-size", "1", *wide_options(ctx, dry_dump)]
    dry_run = Launch(ctx, "wide_bf16_dry_run", dry_run_argv)
    row = _measured(run(ctx, "wide_bf16", [ctx.python, "train.py", *wide_options(ctx, dump)]), dump, _wide_what(ctx))
    dry_run.wait()
    row.estimate_gib = dry_run_estimate(dry_run.text()) if dry_run.ok else None
    if row.estimate_gib is None:
        row.status, row.note = "fail", f"{row.note}; dry run: {dry_run.failure() if not dry_run.ok else 'no estimate'}"
    elif row.peak_gib is not None:
        row.note += f"; peak {row.peak_gib / row.estimate_gib:.2f}x the dry run's estimate (eager)"
    ctx.results["wide_bf16"] = row
    return row


def step_wide_float8(ctx: Context) -> Row:
    if not ctx.machine.get("float8"):
        return Row("", "skip", note=f"no float8 matmuls here ({ctx.machine.get('float8_why', '')})")
    if not ctx.machine.get("torchao"):
        return Row("", "skip", note="torchao is not installed (float8 trains through it; give its wheel with --wheels)")
    dump = ctx.dump("wide_float8")
    options = wide_options(ctx, dump, "--model.converters", "float8", *ctx.sizes.float8)
    row = _measured(run(ctx, "wide_float8", [ctx.python, "train.py", *options]), dump, _wide_what(ctx, ", float8"))
    bf16 = ctx.results.get("wide_bf16")
    if row.tps and bf16 is not None and bf16.tps:
        row.note += f"; {row.tps / bf16.tps:.2f}x wide_bf16's tokens/s"
    return row


def step_async_checkpoint(ctx: Context) -> Row:
    """Saves asynchronously, then a second launch of the same job resumes from the last save and trains on."""
    first, interval, second = ctx.sizes.checkpoint_steps
    dump = ctx.dump("async_checkpoint")
    options = ["--checkpoint.enable", "--checkpoint.async_mode", "async", "--checkpoint.interval", str(interval)]
    argv = [ctx.python, "train.py", *debug_options(ctx, dump, *options)]
    saving = run(ctx, "async_checkpoint", [*argv, "--training.steps", str(first)])
    marker = os.path.join(dump, "checkpoint", f"step-{first}", "checkpoint_complete.json")
    if not saving.ok or not os.path.exists(marker):
        return Row("", "fail", note=f"save: {saving.failure() if not saving.ok else f'no {marker}'}")
    resuming = run(ctx, "async_checkpoint", [*argv, "--training.steps", str(second)])
    resumed = re.findall(r"\bINFO resumed from step (\d+)$", resuming.text(), re.M)
    after = [r["step"] for r in read_metrics(dump) if r["step"] > first]
    if not resuming.ok or resumed != [str(first)] or after != list(range(first + 1, second + 1)):
        why = resuming.failure() if not resuming.ok else f"resumed from {resumed or 'nothing'}, then steps {after}"
        return Row("", "fail", note=f"resume: {why}")
    row = _measured(resuming, dump, f"saved every {interval} steps asynchronously, resumed from step {first}")
    row.note = row.note.replace("; loss", f", trained steps {first + 1}-{second}; loss", 1)
    return row


def titan_log_figures(text: str) -> dict[str, Any]:
    """torchtitan's step lines: medians from FIRST_TIMED_STEP on, peak reserved memory, the last step."""
    steps = []
    for match in TITAN_STEP.finditer(ANSI.sub("", text)):
        step, loss, memory, tps, tflops, mfu = match.groups()
        steps.append(
            {"step": int(step), "loss": float(loss), "memory": float(memory), "tps": float(tps.replace(",", ""))}
            | {"tflops": float(tflops.replace(",", "")) if tflops else None, "mfu": float(mfu) if mfu else None}
        )
    timed = [s for s in steps if s["step"] >= FIRST_TIMED_STEP] or steps[-1:]
    return {
        "tps": _median([s["tps"] for s in timed]),
        "tflops": _median([s["tflops"] for s in timed]),
        "mfu": _median([s["mfu"] for s in timed]),
        "peak_gib": max((s["memory"] for s in steps), default=None),
        "last_step": steps[-1]["step"] if steps else None,
    }


def titan_options(ctx: Context, assets: str, dump: str) -> list[str]:
    """torchtitan's spelling of the 8B-wide job on the shared tokenizer and documents."""
    options = {
        "--model.name": "llama3",
        "--model.flavor": TITAN_FLAVOR,
        "--model.hf_assets_path": assets,
        "--training.dataset": "c4_test",
        "--training.dataset_path": os.path.join(assets, "corpus"),  # torchtitan reads the folder
        "--training.mixed_precision_param": "bfloat16",
        "--activation_checkpoint.mode": "full",
        "--lr_scheduler.warmup_steps": "2",
        "--metrics.log_freq": "1",
        "--job.dump_folder": dump,
    }
    flags = [item for pair in options.items() for item in pair]
    return [*flags, *ctx.sizes.wide, "--compile.enable", "--metrics.disable_color_printing"]


def _titan_run(ctx: Context, assets: str) -> tuple[dict[str, Any] | None, str]:
    """torchtitan's launch: its figures, or None and why (a module it lacks makes the step a skip)."""
    env = dict(ctx.env, PYTHONPATH=os.pathsep.join([str(ctx.titan_site), ctx.env["PYTHONPATH"]]))
    torchrun = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    model = json.dumps(ctx.sizes.wide_model)
    dump = ctx.dump("torchtitan")
    worker = [WORKER, "titan", TITAN_FLAVOR, model, ctx.titan_launcher or ""]
    launch = run(ctx, "torchtitan", [*torchrun, *worker, *titan_options(ctx, assets, dump)], env)
    found = titan_log_figures(launch.text())
    steps = int(ctx.sizes.wide[ctx.sizes.wide.index("--training.steps") + 1])
    # torchtitan may abort while shutting down, after its last step: every step was measured.
    if found.pop("last_step") == steps:
        return found, ""
    missing = re.search(r"ModuleNotFoundError: No module named '([^']+)'", launch.text())
    if missing:
        return None, f"skip: torchtitan needs module {missing.group(1)}, missing here (--wheels)"
    return None, launch.failure() if not launch.ok else f"not all {steps} steps in its log"


def step_torchtitan(ctx: Context) -> Row:
    """The 8B-wide job through torchtitan v0.2.2, then through Tessera on the same tokenizer and documents."""
    if ctx.titan_skip:
        return Row("", "skip", note=ctx.titan_skip)
    assets = os.path.join(ctx.out, "runs", "shared_assets")
    made = run(ctx, "torchtitan", [ctx.python, WORKER, "assets", assets])
    if not made.ok:
        return Row("", "fail", note=f"tokenizer and documents: {made.failure()}")
    titan, why = _titan_run(ctx, assets)
    if titan is None:
        return Row("", "skip", note=why[len("skip: ") :]) if why.startswith("skip: ") else Row("", "fail", note=why)
    dump = ctx.dump("torchtitan_tessera")
    shared = ["--model.hf_assets_path", assets, "--training.dataset_path", os.path.join(assets, "corpus", "data.json")]
    launch = run(ctx, "torchtitan", [ctx.python, "train.py", *wide_options(ctx, dump, *shared)])
    tessera = _measured(launch, dump, "")
    if tessera.status != "pass":
        return Row("", "fail", note=f"Tessera: {tessera.note}")
    ratio = tessera.tps / titan["tps"] if tessera.tps and titan["tps"] else math.nan
    note = (
        "torchtitan v0.2.2's figures (its peak: reserved memory); Tessera on the same tokenizer and documents: "
        f"{tessera.tps or 0:,.0f} tokens/s, peak {tessera.peak_gib or 0:.2f} GiB; Tessera/torchtitan {ratio:.2f}x"
    )
    return Row("", "pass", note=note, **titan)


@dataclass(frozen=True)
class Step:
    """One step of the plan: ``seconds`` is what it is expected to take on an H100 with cold compile
    caches (their sum fits the 480 s budget); bench/gpu_check.py's time_limit derives its limit."""

    name: str
    seconds: float
    run: Callable[[Context], Row]


STEPS = (
    Step("test_cuda", 40, step_test_cuda),
    Step("train_eager", 20, step_train_eager),
    Step("train_compiled", 45, step_train_compiled),
    Step("fsdp2_eager", 15, step_fsdp2_eager),
    Step("fsdp2_compiled", 25, step_fsdp2_compiled),  # train_compiled's block graphs, from Inductor's cache
    Step("simple_fsdp_auto", 55, step_simple_fsdp_auto),
    Step("simple_fsdp_block", 45, step_simple_fsdp_block),
    Step("wide_bf16", 70, step_wide_bf16),
    Step("wide_float8", 55, step_wide_float8),
    Step("async_checkpoint", 25, step_async_checkpoint),
    Step("torchtitan", 85, step_torchtitan),  # Tessera's side compiles from wide_bf16's cache
)
