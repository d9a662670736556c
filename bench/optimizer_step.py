"""Benchmark: one optimizer step with each of AdamW's kernels (fused, foreach, for-loop).

    python bench/optimizer_step.py [--models debugmodel,debugmodel_wide] [--ranks 1,2] [--rounds 7]

Builds each model's parameters (1 thread, float32), gives them random gradients and times
``optimizer.step()`` of the trainer's ``build_optimizer`` with each ``optimizer.implementation``.
``--ranks N`` times one data-parallel rank's share: every parameter cut to its first 1/N rows, as
a dim-0 shard is. The kernels run in turn within each round, so the machine's drift hits them
alike. Prints the median milliseconds and the ratio to ``fused`` (median of the per-round
ratios, with their range) and writes ``bench/results/optimizer_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from bench.dp_compare import machine_info  # noqa: E402
from models.llama3 import llama3_flavors  # noqa: E402
from models.llama3.model import Transformer  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402

IMPLEMENTATIONS = ("fused", "foreach", "for-loop")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="debugmodel,debugmodel_wide")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "optimizer_step.json"))
    return parser.parse_args(argv)


def shard_parameters(model: str, ranks: int) -> list[nn.Parameter]:
    """One rank's dim-0 shard of every parameter of ``model``, with a random gradient."""
    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(llama3_flavors[model]).parameters()]
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.randn(-(-shape[0] // ranks), *shape[1:]))
        param.grad = torch.randn_like(param)
        params.append(param)
    return params


def measure(model: str, ranks: int, rounds: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of one step per round of each kernel, and the parameters stepped."""
    holder = nn.Module()
    holder.params = nn.ParameterList(shard_parameters(model, ranks))
    optimizers = {i: build_optimizer([holder], lr=1e-3, implementation=i) for i in IMPLEMENTATIONS}
    for optimizer in optimizers.values():
        optimizer.step()  # the first step creates the moments
    times: dict[str, list[float]] = {i: [] for i in IMPLEMENTATIONS}
    for _ in range(rounds):
        for implementation, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[implementation].append(time.perf_counter() - start)
    return times, sum(p.numel() for p in holder.parameters())


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    header = f"{'model':<16} {'ranks':>5} {'params M':>8} " + " ".join(f"{i + ' ms':>12}" for i in IMPLEMENTATIONS)
    header += " " + " ".join(f"{i + '/fused':>22}" for i in IMPLEMENTATIONS[1:])
    print(header + "\n" + "-" * len(header))
    for model in args.models.split(","):
        for ranks in (int(n) for n in args.ranks.split(",")):
            times, n_params = measure(model, ranks, args.rounds)
            ratios = {i: [t / f for t, f in zip(times[i], times["fused"], strict=True)] for i in IMPLEMENTATIONS[1:]}
            row = {
                "model": model,
                "ranks": ranks,
                "params_per_rank": n_params,
                "seconds": times,
                "median_ms": {i: statistics.median(t) * 1e3 for i, t in times.items()},
                "ratio_to_fused": {
                    i: {"median": statistics.median(r), "min": min(r), "max": max(r)} for i, r in ratios.items()
                },
            }
            rows.append(row)
            cells = " ".join(f"{row['median_ms'][i]:>12.1f}" for i in IMPLEMENTATIONS)
            spreads = " ".join(
                f"{'{median:.2f} ({min:.2f}-{max:.2f})'.format(**s):>22}" for s in row["ratio_to_fused"].values()
            )
            print(f"{model:<16} {ranks:>5} {n_params / 1e6:>8.1f} {cells} {spreads}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info() | {"threads": 1}, "rounds": args.rounds, "rows": rows}, f, indent=1)
    print(f"results in {os.path.relpath(args.out, REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
