"""The GPU check: in one command and at most a few minutes, what only a CUDA machine can show.

    scripts/gpu_check.sh [--out DIR] [--budget-s S] [--only STEP,...] [--wheels DIR]
                         [--torchtitan-wheel PATH] [--rehearse]

Runs the steps of bench/gpu_check_steps.py in order: tests/distributed/test_cuda.py; the debug model
through train.py eager and compiled, and under FSDP2 and SimpleFSDP (auto and block buckets) on a
one-rank mesh, its losses against train.py's eager ones; Llama 3 8B cut to a few blocks at seq 8192
in bf16, and in float8; an asynchronous checkpoint and its resume; the 8B job through torchtitan
v0.2.2 beside Tessera, all within --budget-s (480 s). A step may take up to twice its expected
seconds while the steps after it keep half of theirs; one out of time is stopped and fails, and
the check goes on.

Prints one table (also DIR/gpu_check.md) and writes DIR/gpu_check.json (the machine and the rows),
rewritten after every step, so a run that is killed keeps what it measured; each step's log is in
DIR/logs/. Exit status 0 when no step failed (skips allowed), 1 when one did, 2 for a bad option or
missing Python modules (one line naming them). Nothing is downloaded: --wheels DIR installs what is
missing from that folder only, and --torchtitan-wheel PATH installs torchtitan for its step only.

Without an NVIDIA GPU it prints one line and exits 0. --rehearse runs the whole plan on the CPU
instead (gloo, toy sizes, CUDA hidden), proving the command lines, the parsing and the JSON before
a GPU is at hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import importlib.machinery
import importlib.metadata
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.gpu_check_steps import (
    GPU_SIZES,
    REHEARSAL_SIZES,
    STEPS,
    TITAN_MODULES,
    Context,
    Row,
    Step,
)

DEFAULT_BUDGET_S = 480.0
REHEARSAL_TIME_FACTOR = 4  # a rehearsal's default budget: the CPU compiles and trains slower
MIN_STEP_S = 10  # a step whose time limit would be shorter does not start
STEP_CAP, RESERVE = 2.0, 0.5  # see time_limit
OUTPUTS = os.path.join(REPO, "outputs", "gpu_check")
TITAN_CPU_LAUNCHER = os.path.join(REPO, "..", "shared", "anchors", "torchtitan-v0.2.2", "titan_cpu.py")
# What train.py and the dry run import beyond the standard library.
REQUIRED_MODULES = ("torch", "numpy", "torchdata", "sentencepiece", "tiktoken", "tokenizers", "safetensors")
PY310_MODULES = ("tomli",) if sys.version_info < (3, 11) else ()  # tomllib's stand-in
NO_GPU = "gpu_check: no NVIDIA GPU on this machine, nothing to check (--rehearse runs the plan on the CPU)"

# Run in the interpreter under test: what the machine has, and whether Tessera's entry points import.
PROBE = r"""
import json, sys
info = {"python": sys.version.split()[0]}
try:
    import torch
except ModuleNotFoundError as e:
    print(json.dumps({**info, "missing_import": e.name}))
    sys.exit()
from parallelisms import device
cuda = torch.cuda.is_available()
info.update(torch=torch.__version__, cuda=torch.version.cuda, float8=device.float8_matmuls("cuda" if cuda else "cpu"))
info["gpus"] = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())] if cuda else []
info["gpus"] = [{"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}"}
                for p in info["gpus"]]
info["float8_why"] = f"compute capability {info['gpus'][0]['capability']}" if cuda else "CPU"
if cuda:
    info["bf16_peak"] = str(device.device_peak(torch.device("cuda", 0), torch.bfloat16))
try:
    import trainer.trainer, programs.dry_run
except ModuleNotFoundError as e:
    info["missing_import"] = e.name
print(json.dumps(info))
"""


class _OneLineParser(argparse.ArgumentParser):
    """A bad option is one line naming it, exit 2."""

    def error(self, message: str) -> None:
        print(f"gpu_check: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    names = [step.name for step in STEPS]
    parser.add_argument("--out", help="results folder (default: outputs/gpu_check/<date-time>)")
    parser.add_argument("--budget-s", type=float, help=f"seconds for all steps (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--only", help=f"comma-separated steps to run, from: {', '.join(names)}")
    parser.add_argument("--wheels", help="a folder of wheels: those of missing packages are installed (no index)")
    parser.add_argument("--torchtitan-wheel", help="torchtitan v0.2.2's wheel, for the torchtitan step")
    parser.add_argument("--rehearse", action="store_true", help="the whole plan on the CPU at toy sizes")
    args = parser.parse_args(argv)
    if args.budget_s is not None and not args.budget_s > 0:
        parser.error(f"--budget-s must be more than 0 seconds, got {args.budget_s:g}")
    unknown = [name for name in (args.only or "").split(",") if name and name not in names]
    if unknown:
        parser.error(f"--only: unknown step {', '.join(unknown)} (steps: {', '.join(names)})")
    args.steps = [s for s in STEPS if not args.only or s.name in args.only.split(",")]
    if args.wheels is not None and not os.path.isdir(args.wheels):
        parser.error(f"--wheels: {args.wheels} is not a folder")
    if args.torchtitan_wheel is not None and not (
        os.path.isfile(args.torchtitan_wheel) and args.torchtitan_wheel.endswith(".whl")
    ):
        parser.error(f"--torchtitan-wheel: {args.torchtitan_wheel} is not a wheel file")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = os.path.abspath(args.out or os.path.join(OUTPUTS, ("rehearsal-" if args.rehearse else "") + stamp))
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S * (REHEARSAL_TIME_FACTOR if args.rehearse else 1)
    return args


def nvidia_devices() -> int:
    """NVIDIA GPUs the driver shows, found without torch (which may be missing)."""
    return max(len(glob.glob("/dev/nvidia[0-9]*")), len(glob.glob("/proc/driver/nvidia/gpus/*")))


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions(paths: list[str]) -> set[str]:
    return {normalized(d.metadata["Name"]) for d in importlib.metadata.distributions(path=paths) if d.metadata["Name"]}


def _pip_install(python: str, target: str, *requirements: str, find_links: str | None = None) -> str | None:
    """pip without an index into ``target``, no dependencies; None, or pip's last error line."""
    links = ["--find-links", find_links] if find_links else []
    argv = [python, "-m", "pip", "install", "--quiet", "--no-index", *links, "--no-deps", "--target", target]
    result = subprocess.run([*argv, *requirements], capture_output=True, text=True, timeout=600)
    if result.returncode == 0:
        return None
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "ERROR" in line), lines[-1] if lines else "pip failed")


def install_wheels(python: str, folder: str, target: str) -> tuple[list[str], list[str]]:
    """Installs into ``target`` the packages of ``folder``'s wheels that are not installed; returns
    (installed, "name: pip's error" for each that failed)."""
    names = {normalized(os.path.basename(f).split("-")[0]) for f in glob.glob(os.path.join(folder, "*.whl"))}
    wanted = sorted(names - installed_distributions([target, *sys.path]))
    if not wanted or _pip_install(python, target, *wanted, find_links=folder) is None:
        return wanted, []
    # One at a time: a wheel for another platform must not keep the others out.
    errors = {name: _pip_install(python, target, name, find_links=folder) for name in wanted}
    return [n for n, e in errors.items() if e is None], [f"{n}: {e}" for n, e in errors.items() if e is not None]


def module_found(name: str, extra_paths: list[str]) -> bool:
    return importlib.machinery.PathFinder.find_spec(name, [*extra_paths, *sys.path]) is not None


def child_env(sites: list[str], rehearse: bool) -> dict[str, str]:
    """Every launch's environment: the repository and installed wheels first on the path, one tokenizer cache."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, *sites, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("TESSERA_CACHE_DIR", os.path.join(OUTPUTS, "cache"))  # the tokenizer trains once for all
    if rehearse:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # a worker pool only adds processes on 2 cores
    return env


def probe(python: str, env: dict[str, str]) -> dict[str, Any]:
    try:
        result = subprocess.run([python, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RuntimeError("the machine probe took over 300 s (torch's import or CUDA's start hangs)") from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["no output"]
        raise RuntimeError(f"the machine probe failed: {lines[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def missing_modules(machine: dict[str, Any], sites: list[str]) -> list[str]:
    missing = [m for m in (*REQUIRED_MODULES, *PY310_MODULES) if not module_found(m, sites)]
    if machine.get("missing_import") and machine["missing_import"] not in missing:
        missing.append(machine["missing_import"])
    return missing


def missing_line(missing: list[str]) -> str:
    return (
        f"gpu_check: missing Python modules: {', '.join(missing)} "
        "(nothing is downloaded here: give their wheels with --wheels DIR)"
    )


def machine_info(machine: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    except OSError:  # no git on the machine
        commit = None
    gpus = machine.get("gpus", [])
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu_name": gpus[0]["name"] if gpus else None,
        "gpu_count": len(gpus),
        **machine,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "commit": commit.stdout.strip() or None if commit else None,
        "rehearsal": args.rehearse,
        "budget_s": args.budget_s,
    }


def prepare(args: argparse.Namespace) -> Context | int:
    """The steps' context, or the exit status when the check cannot run (after its one line)."""
    if not args.rehearse and nvidia_devices() == 0:
        print(NO_GPU)
        return 0
    try:
        os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    except OSError as e:
        print(f"gpu_check: error: --out: cannot create {args.out} ({e.strerror})", file=sys.stderr)
        return 2
    site, installed = os.path.join(args.out, "site"), []
    if args.wheels:
        installed, failed = install_wheels(sys.executable, args.wheels, site)
        if failed:
            print(f"gpu_check: warning: --wheels: not installed: {'; '.join(failed)}", file=sys.stderr)
    env = child_env([site], args.rehearse)
    try:
        machine = probe(sys.executable, env)
    except RuntimeError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 1
    if missing := missing_modules(machine, [site]):
        print(missing_line(missing))
        return 2
    if not args.rehearse and not machine["gpus"]:
        found = nvidia_devices()
        print(
            f"gpu_check: error: torch {machine['torch']} sees none of the {found} NVIDIA devices here", file=sys.stderr
        )
        return 1
    machine.update(wheels_installed=installed, pytest=module_found("pytest", [site]))
    machine["torchao"] = module_found("torchao", [site])
    sizes = REHEARSAL_SIZES if args.rehearse else GPU_SIZES
    ctx = Context(args.out, sys.executable, env, sizes, machine_info(machine, args), rehearse=args.rehearse)
    prepare_torchtitan(ctx, args.torchtitan_wheel, site)
    return ctx


def prepare_torchtitan(ctx: Context, wheel: str | None, site: str) -> None:
    """Installs torchtitan for its step, else says in ``ctx.titan_skip`` why the step skips."""
    if wheel is None:
        return
    if ctx.rehearse:
        if not os.path.exists(TITAN_CPU_LAUNCHER):
            ctx.titan_skip = f"a rehearsal runs torchtitan through {TITAN_CPU_LAUNCHER}, missing here"
            return
        ctx.titan_launcher = os.path.abspath(TITAN_CPU_LAUNCHER)
    target = os.path.join(ctx.out, "torchtitan_site")
    error = _pip_install(ctx.python, target, wheel) if not module_found("torchtitan", [target]) else None
    missing = [m for m in (*TITAN_MODULES, *PY310_MODULES) if not module_found(m, [target, site])]
    if error:
        ctx.titan_skip = f"cannot install {wheel}: {error}"
    elif missing:
        ctx.titan_skip = f"torchtitan needs modules missing here: {', '.join(missing)} (--wheels)"
    else:
        ctx.titan_site, ctx.titan_skip = target, ""


def time_limit(steps: Sequence[Step], i: int, left: float, scale: float) -> float:
    """Step ``i``'s time limit: up to STEP_CAP times its expected seconds, as long as the steps after
    it keep RESERVE of theirs (a slow step runs on; a hung one cannot take the others' time)."""
    later = sum(step.seconds for step in steps[i + 1 :])
    return min(STEP_CAP * steps[i].seconds * scale, left - RESERVE * later * scale)


def run_plan(
    ctx: Context, steps: Sequence[Step], budget_s: float, on_row: Callable[[list[Row]], None], scale: float = 1
) -> list[Row]:
    """Runs ``steps`` in order within ``budget_s``, their expected seconds times ``scale``; ``on_row`` after each."""
    rows: list[Row] = []
    start = time.monotonic()
    for i, step in enumerate(steps):
        left = budget_s - (time.monotonic() - start)
        limit = time_limit(steps, i, left, scale)
        began = time.monotonic()
        if limit < MIN_STEP_S:
            row = Row(step.name, "skip", note=f"budget spent ({max(left, 0):.0f} s of --budget-s left)")
        else:
            ctx.step_deadline = began + limit
            try:
                row = step.run(ctx)
            except Exception as e:  # noqa: BLE001 - a bug in one step's reading must not lose the others
                row = Row(step.name, "fail", note=f"the check's own error: {type(e).__name__}: {e}")
            except BaseException:  # Ctrl-C or SIGTERM: the step is recorded, nothing it started outlives it
                for launch in list(ctx.running):
                    launch.stop()
                on_row([*rows, Row(step.name, "fail", time.monotonic() - began, note="interrupted")])
                raise
        row.step, row.seconds = step.name, time.monotonic() - began
        rows.append(row)
        on_row(rows)
    return rows


def _cell(value: float | None, spec: str) -> str:
    return "" if value is None or not math.isfinite(value) else format(value, spec)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| step | status | seconds | tokens/s | TFLOP/s | MFU % | peak GiB | estimate GiB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.step, r.status, f"{r.seconds:.0f}", _cell(r.tps, ",.0f"), _cell(r.tflops, ".3g")]
        cells += [_cell(r.mfu, ".1f"), _cell(r.peak_gib, ".2f"), _cell(r.estimate_gib, ".2f"), r.note.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_results(out: str, machine: dict[str, Any], rows: list[Row]) -> str:
    """Rewrites gpu_check.json (whole, then renamed into place) and gpu_check.md; returns the JSON's path."""
    path = os.path.join(out, "gpu_check.json")
    payload = {"machine": machine, "rows": [{k: _finite(v) for k, v in dataclasses.asdict(r).items()} for r in rows]}
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(table(rows) + "\n")
    return path


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    ctx = prepare(args)
    if isinstance(ctx, int):
        return ctx
    m = ctx.machine
    where = f"{m['gpu_name']} x {m['gpu_count']}" if m["gpu_count"] else "CPU rehearsal"
    print(f"gpu_check: {where}, torch {m['torch']}, CUDA {m['cuda']}; budget {args.budget_s:.0f} s; {args.out}")

    def on_row(rows: list[Row]) -> None:
        write_results(args.out, ctx.machine, rows)
        r = rows[-1]
        print(f"  {r.step}: {r.status} in {r.seconds:.0f} s{': ' + r.note if r.status != 'pass' else ''}", flush=True)

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stops the launches too
    try:
        rows = run_plan(ctx, args.steps, args.budget_s, on_row, REHEARSAL_TIME_FACTOR if args.rehearse else 1)
    except KeyboardInterrupt:
        print(f"gpu_check: interrupted; what was measured is in {os.path.join(args.out, 'gpu_check.json')}")
        return 130
    print(table(rows))  # on_row has written the results
    print(f"results: {os.path.join(args.out, 'gpu_check.json')}; logs: {os.path.join(args.out, 'logs')}")
    return exit_status(rows)


def exit_status(rows: list[Row]) -> int:
    """0 when no step failed (skips allowed), else 1."""
    return 1 if any(r.status == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
