"""Benchmark: the layout planner's ranking and step times against real runs on this machine.

    python bench/plan_vs_measured.py --devices 2 [--rounds 2] [--steps 16] [--top 10] [--out PATH]

Calibrates the planner on ``--devices`` CPU ranks of this machine (``python -m programs.calibrate``;
``--calibration FILE`` takes a calibration made before, ``--calibration figures`` plans with
``MACHINE``'s ``[plan]`` figures instead), plans ``configs/debug_model.toml`` (the debug model, seq
256, 8 sequences per rank) on those ranks, and trains for real, through ``run_train.sh`` with the
config file the planner writes for each: its ``--top`` fastest predicted layouts (without
activation checkpointing), DDP with the debug config's 8 sequences per microbatch, and the debug
config unchanged. Runs use this machine's default precision (``mixed_precision_param = "auto"``:
the planner writes bf16, as on GPUs). A launch's figure is its median tokens/s per device over steps
4 to ``--steps`` (a rank's tokens/s over the tensor-parallel degree: those ranks share their
tokens); its step time is the step's tokens over the devices' tokens/s. Rounds alternate the order.

Reports, as the planner's acceptance asks: the Spearman correlation of predicted and measured
tokens/s over the top ``--top``; how far the planner's first pick measures below the best layout
measured; each layout's predicted step time against the measured one. Prints the table and writes
``bench/results/plan_vs_measured_<devices>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from config.manager import load_config, to_toml
from programs import plan, time_model

DEBUG_CONFIG = os.path.join(REPO, "configs", "debug_model.toml")
# This 2-core machine: the trainer's logged rate of debugmodel's float32 steps on one thread and
# auto bucketing's all-gather calibration over gloo ranks.
MACHINE = [
    *("--plan.peak_tflops", "0.208", "--plan.mfu", "0.5", "--plan.intra_node_gbps", "1.7"),
    *("--plan.inter_node_gbps", "1.7", "--plan.link_latency_us", "337", "--plan.activation_checkpoint_modes", "none"),
]
FIRST_TIMED_STEP = 4
UNCHANGED = "debug config unchanged"


def candidates(
    config, top: int, calibration: time_model.Calibration | None
) -> list[tuple[str, plan.Layout | None, float | None]]:
    """(name, layout, predicted step seconds): the ``top`` fastest predicted, DDP at the debug config's
    microbatch, and the debug config unchanged (no layout, no prediction). Without data parallelism
    the implementation makes no difference: FSDP2 stands for both."""
    shape = plan.model_shape(config)
    layouts = [
        lay for lay in plan.enumerate_layouts(config, shape) if lay.replicate * lay.shard > 1 or lay.impl == "fsdp2"
    ]
    rates = time_model.Rates(config, shape, calibration)
    batch = plan.global_batch(config)
    timed = sorted(((lay, time_model.step_seconds(rates, lay, batch)) for lay in layouts), key=lambda t: t[1])
    chosen = timed[:top]
    ddp = next(
        (t for t in timed if t[0].shard == 1 and t[0].replicate > 1 and t[0].microbatch == 8 and t[0].impl == "fsdp2"),
        None,
    )
    if ddp is not None and ddp not in chosen:
        chosen.append(ddp)
    return [(lay.describe(), lay, seconds) for lay, seconds in chosen] + [(UNCHANGED, None, None)]


def calibrate(devices: int, scratch: str) -> str:
    """Runs the planner's calibration on ``devices`` CPU ranks of this machine; returns its file."""
    path = os.path.join(scratch, "calibration.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}"]
    command += ["-m", "programs.calibrate", "--job.config_file", DEBUG_CONFIG, "--plan.calibration_file", path]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    return path


def measure(config, layout: plan.Layout | None, devices: int, steps: int, scratch: str, name: str) -> float:
    """One launch through run_train.sh: the median tokens/s per device of the timed steps."""
    if layout is None:
        config_file = DEBUG_CONFIG
    else:
        config_file = os.path.join(scratch, f"{name}.toml")
        with open(config_file, "w") as f:
            f.write(to_toml(plan.layout_config(config, layout)))
    dump = os.path.join(scratch, name)
    options = ["--job.config_file", config_file, "--training.steps", str(steps), "--metrics.log_freq", "1"]
    options += ["--training.mixed_precision_param", "auto", "--metrics.enable_tensorboard", "false"]
    options += ["--job.dump_folder", dump, "--checkpoint.enable", "false"]
    env = dict(os.environ, NGPU=str(devices), OMP_NUM_THREADS="1", MAX_RESTARTS="0")
    proc = subprocess.run(
        [os.path.join(REPO, "run_train.sh"), *options], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n" + proc.stderr[-2000:])
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    tp = layout.tp if layout is not None else 1
    return statistics.median(r["tps"] / tp for r in records if "tps" in r and r["step"] >= FIRST_TIMED_STEP)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (ties share their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def summarize(config, rows: list[dict[str, Any]], top: int) -> dict[str, Any]:
    tokens = plan.global_batch(config) * config.training.seq_len
    devices = config.plan.devices
    for row in rows:
        row["measured_tps"] = statistics.median(row["rounds_tps"])
        row["measured_step_s"] = tokens / devices / row["measured_tps"]
        if row["predicted_step_s"] is not None:
            row["predicted_tps"] = tokens / devices / row["predicted_step_s"]
            row["step_error"] = row["predicted_step_s"] / row["measured_step_s"] - 1
    ranked = [r for r in rows if r["predicted_step_s"] is not None][:top]
    best = max(r["measured_tps"] for r in rows)
    return {
        "spearman_top": spearman([r["predicted_tps"] for r in ranked], [r["measured_tps"] for r in ranked]),
        "first_pick_below_best": 1 - ranked[0]["measured_tps"] / best,
        "worst_step_error": max(abs(r["step_error"]) for r in rows if "step_error" in r),
    }


def table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| layout | predicted tok/s/dev (step s) | measured tok/s/dev, median [min-max] (step s) | step error |",
        "|---|---|---|---|",
    ]
    for row in rows:
        got = row["rounds_tps"]
        predicted = (
            "-" if row["predicted_step_s"] is None else f"{row['predicted_tps']:,.0f} ({row['predicted_step_s']:.2f})"
        )
        error = f"{row['step_error']:+.0%}" if "step_error" in row else "-"
        lines.append(
            f"| {row['layout']} | {predicted} | {row['measured_tps']:,.0f} [{min(got):,.0f}-{max(got):,.0f}] "
            f"({row['measured_step_s']:.2f}) | {error} |"
        )
    lines.append(
        f"\nSpearman over the top: {summary['spearman_top']:.2f}; first pick {summary['first_pick_below_best']:.1%} "
        f"below the best measured; largest step-time error {summary['worst_step_error']:.0%}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=10, help="how many of the fastest predicted to measure")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--calibration", default="", help="a calibration file, 'figures' for MACHINE's; default: calibrate first"
    )
    args = parser.parse_args(argv)
    devices = ["--plan.devices", str(args.devices), "--plan.devices_per_node", str(args.devices)]
    config = load_config(["--job.config_file", DEBUG_CONFIG, *devices, *MACHINE])
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as scratch:
        calibration_file = args.calibration or calibrate(args.devices, scratch)
        calibration = time_model.read_calibration(calibration_file) if calibration_file != "figures" else None
        chosen = candidates(config, args.top, calibration)
        rows = [{"layout": name, "predicted_step_s": seconds, "rounds_tps": []} for name, _, seconds in chosen]
        for round_index in range(args.rounds):
            order = list(enumerate(chosen))
            for i, (name, layout, _) in order if round_index % 2 == 0 else order[::-1]:
                tps = measure(config, layout, args.devices, args.steps, scratch, f"r{round_index}-{i}")
                rows[i]["rounds_tps"].append(tps)
                print(f"round {round_index + 1}: {name}: {tps:,.0f} tokens/s per device", file=sys.stderr, flush=True)
    summary = summarize(config, rows, args.top)
    print(table(rows, summary))
    out = args.out or os.path.join(REPO, "bench", "results", f"plan_vs_measured_{args.devices}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        info = {"date": started, "devices": args.devices, "rounds": args.rounds, "steps": args.steps}
        info["calibration"] = calibration.__dict__ if calibration else "figures"
        json.dump({"info": info | {"machine": MACHINE}, "summary": summary, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
