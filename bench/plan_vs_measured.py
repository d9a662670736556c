"""Benchmark: the layout planner's ranking of 2-rank layouts against their measured tokens/s.

    python bench/plan_vs_measured.py [--rounds 2] [--steps 10] [--flavor debugmodel] [--layouts N]

Plans ``--flavor`` on 2 devices described as this machine (``MACHINE``: one CPU core per rank, a
gloo link between them, figures from the trainer's own calibration logs) for seq 512 and 8
sequences per step, without activation checkpointing. Every layout the planner enumerates (data
parallel FSDP2 or SimpleFSDP, TP 2, PP 2 with each schedule, each microbatch size; without data
parallelism the implementation makes no difference and FSDP2 stands for both) gets the planner's
predicted tokens/s per device, and the ``--layouts`` fastest predicted are trained for real
through ``torchrun train.py`` with the config file the planner writes for them (compile on), in
this machine's default precision (``mixed_precision_param = "auto"``: the planner writes bf16, as
on GPUs, which a CPU without bf16 instructions emulates about 19 times slower than fp32).
Rounds alternate the launch order. A launch's figure is its median tokens/s per device from step 3 (a rank's tokens/s over the
tensor-parallel degree: those ranks share their tokens).

Agreement (the planner's question): its first choice is the measured fastest, or the measured
ranges of the two overlap. Writes ``bench/results/plan_vs_measured.json`` and prints the table.
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
from programs import plan

MACHINE = [
    # 2026-11-23 logs of this 2-core AMD EPYC without AVX512 (float32, as `auto` picks here): the
    # trainer's matmul benchmark, 0.077 TFLOP/s on one thread, of which debugmodel's FSDP2 steps
    # reach about half; auto bucketing's all-gather calibration over 2 gloo ranks, alpha 419-602
    # us, 0.55-0.86 GB/s.
    *("--plan.devices", "2", "--plan.devices_per_node", "2", "--plan.peak_tflops", "0.077", "--plan.mfu", "0.5"),
    *("--plan.intra_node_gbps", "0.7", "--plan.inter_node_gbps", "0.7", "--plan.link_latency_us", "500"),
    *("--plan.activation_checkpoint_modes", "none"),
]
FIRST_TIMED_STEP = 3


def candidates(config) -> list[tuple[plan.Layout, float]]:
    """(layout, predicted tokens/s per device), fastest first; FSDP2 alone without data parallelism."""
    shape = plan.model_shape(config)
    tokens = plan.global_batch(config) * config.training.seq_len
    layouts = [
        lay for lay in plan.enumerate_layouts(config, shape) if lay.replicate * lay.shard > 1 or lay.impl == "fsdp2"
    ]
    timed = [(lay, tokens / plan.step_seconds(config, shape, lay) / config.plan.devices) for lay in layouts]
    return sorted(timed, key=lambda t: -t[1])


def measure(config, layout: plan.Layout, steps: int, scratch: str, name: str, timeout: float) -> dict[str, Any]:
    """One real launch of the planner's config for ``layout``."""
    toml = os.path.join(scratch, f"{name}.toml")
    with open(toml, "w") as f:
        f.write(to_toml(plan.layout_config(config, layout)))
    dump = os.path.join(scratch, name)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py"]
    command += ["--job.config_file", toml, "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2"]
    command += ["--metrics.log_freq", "1", "--training.mixed_precision_param", "auto"]
    command += ["--metrics.enable_tensorboard", "false", "--job.dump_folder", dump]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout.describe()}: exit {proc.returncode}\n" + proc.stderr[-2000:])
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # tps counts a rank's tokens (divided by the pipeline degree, as torchtitan does): the ranks of
    # a tensor-parallel group count the same tokens, so a device's share is tps / tp.
    timed = [r["tps"] / layout.tp for r in records if "tps" in r and r["step"] >= FIRST_TIMED_STEP]
    return {"median_tps": statistics.median(timed), "tps": timed}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", type=int, default=6, help="how many of the fastest predicted to measure")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "plan_vs_measured.json"))
    args = parser.parse_args(argv)
    config = load_config(
        ["--model.flavor", args.flavor, "--training.seq_len", "512", "--training.global_batch_size", "8", *MACHINE]
    )
    ranked = candidates(config)[: args.layouts]
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    measured: dict[str, list[float]] = {lay.describe(): [] for lay, _ in ranked}
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as scratch:
        for round_index in range(args.rounds):
            order = ranked if round_index % 2 == 0 else ranked[::-1]
            for i, (layout, _) in enumerate(order):
                result = measure(config, layout, args.steps, scratch, f"r{round_index}-{i}", args.timeout)
                measured[layout.describe()].append(result["median_tps"])
                print(f"round {round_index + 1}: {layout.describe()}: {result['median_tps']:,.0f} tokens/s", flush=True)

    rows = []
    for rank, (layout, predicted) in enumerate(ranked, 1):
        got = measured[layout.describe()]
        rows.append(
            {
                "layout": layout.describe(),
                "predicted_rank": rank,
                "predicted_tps": predicted,
                "measured_median_tps": statistics.median(got),
                "measured_tps": got,
            }
        )
    order = sorted(rows, key=lambda r: -r["measured_median_tps"])
    for rank, row in enumerate(order, 1):
        row["measured_rank"] = rank
    first, best = rows[0], order[0]
    agrees = first is best or max(first["measured_tps"]) >= min(best["measured_tps"])
    lines = [
        "| layout | predicted tokens/s/device (rank) | measured tokens/s/device, median [min-max] (rank) |",
        "|---|---|---|",
    ]
    for row in rows:
        got = row["measured_tps"]
        lines.append(
            f"| {row['layout']} | {row['predicted_tps']:,.0f} ({row['predicted_rank']}) "
            f"| {row['measured_median_tps']:,.0f} [{min(got):,.0f}-{max(got):,.0f}] ({row['measured_rank']}) |"
        )
    print("\n".join(lines))
    verdict = "agrees" if agrees else "DISAGREES"
    print(f"planner's first choice {first['layout']} {verdict} with the measured fastest {best['layout']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        info = {"date": started, "flavor": args.flavor, "rounds": args.rounds, "steps": args.steps, "machine": MACHINE}
        json.dump({"info": info, "rows": rows, "agrees": agrees}, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if agrees else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
