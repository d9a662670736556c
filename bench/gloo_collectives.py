"""Benchmark: the ways to reduce a gradient bucket, and to gather a parameter bucket, on 2 gloo
ranks, timed alone.

    python bench/gloo_collectives.py [--sizes-mib 3,11,49] [--rounds 3] [--repeats 8]

What data parallelism chooses between on gloo (parallelisms/device.py, used by FSDP2 and by
SimpleFSDP's graph pass). Reductions: gloo's own reduce-scatter (which copies its input and
all-reduces the copy), an all-reduce of the bucket in place followed by a copy of this rank's part,
and an all-to-all of the bucket's chunks followed by their sum. Gathers: gloo's own all-gather, one
broadcast per rank into its slot of the output (issued together, then waited for), and an
all-to-all of the shard repeated once per rank. A size is the full bucket's (the reduction's input,
the gather's output). Each round times every method ``repeats`` times per size (wall and process
CPU time of rank 0, median), the methods interleaved so that the machine's drift hits them alike;
output buffers are allocated once, as a training step's allocator would hand them back. Prints the
median and [min-max] over rounds in milliseconds and writes ``bench/results/gloo_collectives.json``.
Launches itself under ``torchrun --nproc-per-node 2`` with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

METHODS = ("reduce_scatter", "all_reduce", "all_to_all", "all_gather", "broadcasts", "all_to_all_gather")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="3,11,49", help="bucket sizes in MiB (fp32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=8, help="timings per method, size and round")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "gloo_collectives.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def time_method(method: str, bucket, part, received, repeats: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one reduction of ``bucket`` into this rank's ``part``, or one
    gather of ``part`` into ``received``."""
    import torch.distributed as dist

    from parallelisms.device import all_gather_into

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = bucket.numel() // world
    walls, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        if method == "reduce_scatter":
            dist.reduce_scatter_single(part, bucket)
        elif method == "all_reduce":
            dist.all_reduce(bucket)
            part.copy_(bucket[rank * rows : (rank + 1) * rows])
        elif method == "all_to_all":
            dist.all_to_all_single(received, bucket)
            part.copy_(received.view(world, rows).sum(0))
        elif method == "all_gather":
            dist.all_gather_into_tensor(received, part)
        elif method == "broadcasts":
            all_gather_into(received, part, dist.group.WORLD)  # what FSDP2 and the planner run on gloo
        else:
            dist.all_to_all_single(received, part.repeat(world))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bench.dp_compare import machine_info
    from train import exit_without_teardown

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    times: dict[str, dict[str, list[list[float]]]] = {str(s): {m: [] for m in METHODS} for s in sizes}
    for _ in range(args.rounds):
        for size in sizes:
            bucket = torch.randn(size * 2**20 // 4)
            part, received = torch.empty(bucket.numel() // world), torch.empty_like(bucket)
            for method in METHODS:
                times[str(size)][method].append(list(time_method(method, bucket, part, received, args.repeats)))
    if dist.get_rank() == 0:
        result = {"machine": machine_info(), "settings": vars(args), "seconds_wall_cpu_per_round": times}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(format_table(times), flush=True)
    dist.barrier()
    exit_without_teardown(0)


def format_table(times: dict[str, dict[str, list[list[float]]]]) -> str:
    def spread(values: list[float]) -> str:
        ms = [v * 1e3 for v in values]
        return f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]"

    header = f"{'MiB':>4} {'method':<17} {'wall ms':>20} {'CPU ms':>20}"
    lines = [header, "-" * len(header)]
    for size, methods in times.items():
        for method, rounds in methods.items():
            lines.append(
                f"{size:>4} {method:<17} {spread([w for w, _ in rounds]):>20} {spread([c for _, c in rounds]):>20}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.run([*command, "--worker", *argv], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
