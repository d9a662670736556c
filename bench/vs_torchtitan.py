"""Benchmark: Tessera against torchtitan v0.2.2 on the same model, tokenizer, data and batch.

    python bench/vs_torchtitan.py --titan DIR [--launcher PATH] [--model NAME] [--rounds N]
                                  [--steps N] [--variants v1,v2,...] [--quick]

DIR is a torchtitan install made by ``../shared/anchors/torchtitan-v0.2.2/setup.sh DIR`` (its venv,
and the working folder holding torchtitan's debug config, test tokenizer and c4_test stand-in);
PATH is the CPU launcher next to that script (``titan_cpu.py``), found there by default.

Both sides train torchtitan's debug model (dim 256, 6 layers, 16 heads, the test tokenizer's 2,004
tokens) on the same documents, seq 512, local batch 4, no activation checkpointing, through
``torchrun`` with gloo and ``OMP_NUM_THREADS=1`` per rank. ``--model debugmodel_wide`` trains
Tessera's wider flavor instead (dim 1024, 4 layers) at seq 128, local batch 2, as
``bench/dp_compare.py`` does; torchtitan, which has no model of that size, gets one with the same
dimensions through ``bench/titan_flavor.py``. A variant is one setting on both sides:
precision matched (fp32 or bf16) or each side's defaults, 1 or 2 ranks, eager or compiled. Each
round runs every variant on both sides back to back, the side going first alternating between
rounds, so that a ratio compares runs made under the same load. A run's figure is its median
tokens/s per rank from step 3 on (both sides log every step); the table gives the median over the
rounds and the spread of the per-round ratios.

Prints the table (also written as Markdown to ``bench/results/vs_torchtitan.md``) and writes
``bench/results/vs_torchtitan.json`` (every run's per-step tokens/s and losses, machine info); for
the wider model ``vs_torchtitan_debugmodel_wide.md`` and ``.json``.
Both are rewritten after every variant, so a run that stops early keeps what it measured.
Logs go to ``bench/results/vs_torchtitan_logs/``, named by model, variant, side and round. On an
idle 2-core machine one round of the 13 variants takes about 20 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.dp_compare import machine_info, stop_launch  # noqa: E402

RESULTS_DIR = os.path.join(REPO, "bench", "results")
DEFAULT_LAUNCHER = os.path.join(REPO, "..", "shared", "anchors", "torchtitan-v0.2.2", "titan_cpu.py")
TITAN_CONFIG = "torchtitan/models/llama3/train_configs/debug_model.toml"
FIRST_TIMED_STEP = 3

FLAVOR_LAUNCHER = os.path.join(REPO, "bench", "titan_flavor.py")
# Both sides, every model: no activation checkpointing, logged every step.
COMMON = "--activation_checkpoint.mode none --metrics.log_freq 1"
# Per model, its sequence length and local batch: the for the debug model, dp_compare's for
# the wide one (whose steps take 16x the debug model's time per token).
MODEL_SHAPES = {
    "debugmodel": "--training.seq_len 512 --training.local_batch_size 4",
    "debugmodel_wide": "--training.seq_len 128 --training.local_batch_size 2",
}
# The one model torchtitan has itself, the default: any other is registered in torchtitan before it
# starts, and its name is added to the result files' names.
TITAN_OWN_MODEL = "debugmodel"
# The fields a torchtitan llama3 model has, set from Tessera's flavor for a model torchtitan lacks.
TITAN_MODEL_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "multiple_of",
    "ffn_dim_multiplier",
    "norm_eps",
    "rope_theta",
)
FP32 = "--training.mixed_precision_param float32"
BF16 = "--training.mixed_precision_param bfloat16"
SIMPLE_FSDP_AUTO = "--parallelism.data_parallel_impl simple_fsdp --compile.enable --compile.bucketing auto"


@dataclass(frozen=True)
class Variant:
    """One comparison: ``nproc`` ranks, torchtitan's flags and Tessera's (beside COMMON), and the
    words naming it in the table."""

    nproc: int
    titan: str
    tessera: str
    label: str


VARIANTS = {
    "defaults_1rank_eager": Variant(1, "", "", "**defaults**, eager"),
    "defaults_1rank_compile": Variant(1, "--compile.enable", "--compile.enable", "**defaults**, compile"),
    "defaults_fsdp2_eager": Variant(2, "", "", "**defaults**, FSDP2 eager"),
    "defaults_fsdp2_compile": Variant(2, "--compile.enable", "--compile.enable", "**defaults**, FSDP2 + compile"),
    "fp32_1rank_eager": Variant(1, FP32, FP32, "fp32 both, eager"),
    "fp32_1rank_compile": Variant(1, f"{FP32} --compile.enable", f"{FP32} --compile.enable", "fp32 both, compile"),
    "fp32_fsdp2_eager": Variant(2, FP32, FP32, "fp32 both, FSDP2 eager"),
    "fp32_fsdp2_compile": Variant(
        2, f"{FP32} --compile.enable", f"{FP32} --compile.enable", "fp32 both, FSDP2 + compile"
    ),
    "fp32_simplefsdp_auto_vs_fsdp2_compile": Variant(
        2,
        f"{FP32} --compile.enable",
        f"{FP32} {SIMPLE_FSDP_AUTO}",
        "fp32, Tessera SimpleFSDP compiled vs torchtitan FSDP2 + compile",
    ),
    "bf16_1rank_eager": Variant(1, BF16, BF16, "bf16 both, eager"),
    "bf16_fsdp2_eager": Variant(2, BF16, BF16, "bf16 both, FSDP2 eager"),
    "bf16_fsdp2_compile": Variant(
        2, f"{BF16} --compile.enable", f"{BF16} --compile.enable", "bf16 both, FSDP2 + compile"
    ),
    "bf16_simplefsdp_auto_vs_fsdp2_compile": Variant(
        2,
        f"{BF16} --compile.enable",
        f"{BF16} {SIMPLE_FSDP_AUTO}",
        "bf16, Tessera SimpleFSDP compiled vs torchtitan FSDP2 + compile",
    ),
}
QUICK_VARIANTS = ["defaults_1rank_eager", "defaults_fsdp2_eager"]

TITAN_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+).*?tps:\s+([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--titan", required=True, help="folder made by setup.sh (venv/ and run/)")
    parser.add_argument("--launcher", default=DEFAULT_LAUNCHER, help="torchtitan's CPU launcher (titan_cpu.py)")
    parser.add_argument(
        "--model", default=TITAN_OWN_MODEL, choices=list(MODEL_SHAPES), help="the flavor both sides train"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help=f"1 round of 6 steps of {', '.join(QUICK_VARIANTS)}")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.variants = 1, 6, ",".join(QUICK_VARIANTS)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    args.variants = args.variants.split(",")
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}")
    return args


@dataclass(frozen=True)
class Titan:
    """Where torchtitan is: its interpreter, working folder and launcher."""

    python: str
    workdir: str
    launcher: str

    @property
    def tokenizer(self) -> str:
        return os.path.join(self.workdir, "tests", "assets", "tokenizer")

    @property
    def corpus(self) -> str:
        return os.path.join(self.workdir, "tests", "assets", "c4_test", "data.json")


def find_titan(folder: str, launcher: str) -> Titan:
    """The install in ``folder``; exits with one line saying how to make it when a piece is missing."""
    titan = Titan(os.path.join(folder, "venv", "bin", "python"), os.path.join(folder, "run"), os.path.abspath(launcher))
    for path in (titan.python, os.path.join(titan.workdir, TITAN_CONFIG), titan.tokenizer, titan.corpus):
        if not os.path.exists(path):
            sys.exit(
                f"error: --titan: {path} is missing; prepare torchtitan with "
                f"../shared/anchors/torchtitan-v0.2.2/setup.sh {folder}"
            )
    if not os.path.exists(titan.launcher):
        sys.exit(
            f"error: --launcher: {titan.launcher} is missing (titan_cpu.py from ../shared/anchors/torchtitan-v0.2.2)"
        )
    return titan


def titan_model_fields(model: str) -> str:
    """Tessera's flavor ``model`` as the JSON of torchtitan's model fields (for titan_flavor.py)."""
    from models.llama3 import llama3_flavors

    flavor = llama3_flavors[model]
    return json.dumps({name: getattr(flavor, name) for name in TITAN_MODEL_FIELDS})


def command(
    side: str, variant: Variant, model: str, titan: Titan, steps: int, dump_folder: str
) -> tuple[list[str], str]:
    """(the launch's command line, its working folder) for one side of ``variant`` on ``model``."""
    options = variant.titan if side == "torchtitan" else variant.tessera
    flags = f"{COMMON} {MODEL_SHAPES[model]} --model.flavor {model} --training.steps {steps} {options}".split()
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={variant.nproc}"]
    if side == "torchtitan":
        config = ["--job.config_file", TITAN_CONFIG, "--metrics.disable_color_printing"]
        launcher = [titan.launcher]
        if model != TITAN_OWN_MODEL:
            launcher = [FLAVOR_LAUNCHER, titan.launcher, model, titan_model_fields(model)]
        return [
            titan.python,
            *torchrun,
            *launcher,
            *config,
            *flags,
            "--job.dump_folder",
            dump_folder,
        ], titan.workdir
    data = ["--model.hf_assets_path", titan.tokenizer, "--training.dataset_path", titan.corpus]
    config = ["--job.config_file", "configs/debug_model.toml", "--metrics.enable_tensorboard", "false"]
    return [sys.executable, *torchrun, "train.py", *config, *data, *flags, "--job.dump_folder", dump_folder], REPO


def read_steps(side: str, log_text: str, dump_folder: str) -> list[dict[str, float]]:
    """Per step: tokens/s per rank and loss, from torchtitan's console or Tessera's metrics.jsonl."""
    if side == "torchtitan":
        found = TITAN_STEP.findall(ANSI.sub("", log_text))
        return [{"step": int(s), "loss": float(loss), "tps": float(tps.replace(",", ""))} for s, loss, tps in found]
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [{"step": r["step"], "loss": r["loss"], "tps": r["tps"]} for r in records if "tps" in r]


def run(side: str, name: str, titan: Titan, args: argparse.Namespace, round_index: int, scratch: str) -> dict[str, Any]:
    """One launch; returns its steps, median tokens/s and wall time."""
    variant = VARIANTS[name]
    dump_folder = os.path.join(scratch, f"{args.model}-{name}-{side}-{round_index}")
    # A folder left by an earlier run of the script: Tessera appends to its metrics.jsonl (the old
    # steps would count in the median) and would reuse its saved bucket plan.
    shutil.rmtree(dump_folder, ignore_errors=True)
    argv, cwd = command(side, variant, args.model, titan, args.steps, dump_folder)
    log_path = os.path.join(RESULTS_DIR, "vs_torchtitan_logs", f"{args.model}-{name}-{side}-round{round_index}.log")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO if side == "tessera" else "")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop_launch(process)
            raise
    wall = time.perf_counter() - start
    with open(log_path) as f:
        text = f.read()
    if returncode != 0 and side == "tessera":
        raise RuntimeError(f"{side} {name} exited with {returncode}; see {log_path}")
    steps = read_steps(side, text, dump_folder)
    if returncode != 0:
        # torchtitan on gloo sometimes aborts while shutting down, after its last step ("terminate
        # called without an active exception"): every step was measured, so the run counts.
        if not any(s["step"] == args.steps for s in steps):
            raise RuntimeError(f"{side} {name} exited with {returncode}; see {log_path}")
        print(f"note: {side} {name} exited with {returncode} after its last step; see {log_path}", flush=True)
    timed = [s["tps"] for s in steps if s["step"] >= FIRST_TIMED_STEP]
    if not timed:
        raise RuntimeError(f"{side} {name}: no step at or after {FIRST_TIMED_STEP} in {log_path}")
    return {
        "steps": steps,
        "median_tps": statistics.median(timed),
        "wall_s": wall,
        "command": argv,
        "returncode": returncode,
    }


def summarize(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per variant: median tokens/s of each side over the rounds and the per-round ratios."""
    rows = []
    for name, rounds in results.items():
        ratios = [r["tessera"]["median_tps"] / r["torchtitan"]["median_tps"] for r in rounds]
        rows.append(
            {
                "variant": name,
                "ranks": VARIANTS[name].nproc,
                "torchtitan_tps": statistics.median(r["torchtitan"]["median_tps"] for r in rounds),
                "tessera_tps": statistics.median(r["tessera"]["median_tps"] for r in rounds),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "rounds": len(rounds),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], model: str) -> str:
    """The table as the README gives it: the median ratio over the rounds and their range, in bold
    for the defaults."""
    rounds = sorted({row["rounds"] for row in rows})
    lines = [
        f"Measured {info['date']} on {info['cpu_model']} ({info['usable_cores']} cores), torch {info['torch']}, "
        f"model {model}, {'/'.join(map(str, rounds))} rounds.",
        "",
        "| variant | ranks | torchtitan tokens/s | Tessera tokens/s | Tessera / torchtitan |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['ratio_median']:.2f}"
        if row["variant"].startswith("defaults"):
            ratio = f"**{ratio}**"
        lines.append(
            f"| {VARIANTS[row['variant']].label} | {row['ranks']} | {row['torchtitan_tps']:,.0f} "
            f"| {row['tessera_tps']:,.0f} | {ratio} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    titan = find_titan(os.path.abspath(args.titan), args.launcher)
    os.makedirs(os.path.join(RESULTS_DIR, "vs_torchtitan_logs"), exist_ok=True)
    info = machine_info()
    scratch = os.path.join(RESULTS_DIR, "vs_torchtitan_runs")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants}
    for round_index in range(args.rounds):
        # Alternate who goes first, so that a slow drift of the machine favours neither side.
        sides = ("torchtitan", "tessera") if round_index % 2 == 0 else ("tessera", "torchtitan")
        for name in args.variants:
            measured = {side: run(side, name, titan, args, round_index, scratch) for side in sides}
            results[name].append(measured)
            print(
                f"round {round_index + 1}/{args.rounds} {name}: torchtitan {measured['torchtitan']['median_tps']:,.0f}"
                f" tokens/s, Tessera {measured['tessera']['median_tps']:,.0f} "
                f"({measured['tessera']['median_tps'] / measured['torchtitan']['median_tps']:.2f}x)",
                flush=True,
            )
            # After every variant: a later failure or interruption keeps what was measured.
            table = write_results(results, info, args)
    print(table)
    return 0


def write_results(results: dict[str, list[dict[str, Any]]], info: dict[str, Any], args: argparse.Namespace) -> str:
    """Writes the table (Markdown) and every run (JSON) of the variants measured so far; returns the table."""
    rows = summarize({name: rounds for name, rounds in results.items() if rounds})
    info["loadavg_end"] = os.getloadavg()
    table = markdown(rows, info, args.model)
    suffix = ("" if args.model == TITAN_OWN_MODEL else f"_{args.model}") + ("_quick" if args.quick else "")
    with open(os.path.join(RESULTS_DIR, f"vs_torchtitan{suffix}.md"), "w") as f:
        f.write(table)
    with open(os.path.join(RESULTS_DIR, f"vs_torchtitan{suffix}.json"), "w") as f:
        payload = {"machine": info, "args": vars(args), "variants": {n: asdict(VARIANTS[n]) for n in args.variants}}
        json.dump({**payload, "rows": rows, "runs": results}, f, indent=1)
    return table


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
