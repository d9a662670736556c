"""Calibration: times on the machine a plan is for, on every rank at once as training runs, what the
layout planner's time model needs, and writes it to ``plan.calibration_file`` as JSON: one block's
and the rest of the model's forward and backward at each microbatch, each collective's latency and
bus bandwidth, and the fraction of a collective that hides behind compute
(docs/dry-run-and-planner.md)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from config.errors import ConfigError, init_console_logging, print_error, user_input
from config.job_config import JobConfig
from config.manager import help_text, load_config, named_as_given
from models.builder import resolve_precision
from models.llama3.parallelize import fresh_block
from models.registry import get_model_spec
from models.sizes import job_model_args
from parallelisms.cost_model import COLLECTIVES, CommModel, calibrate_collective, forward_backward
from parallelisms.device import attention_dtype, backend_for, causal_query_chunk, document_kernel, synchronize
from programs.time_model import MICROBATCHES
from trainer.distributed import init_distributed
from trainer.loss import summed_cross_entropy

PROGRAM = "python -m programs.calibrate"
# Untimed runs, then timed ones whose median is a rank's figure.
WARMUP, REPEATS = 2, 5
# Bytes of the full buffer (of the message for a send) of the two timings an alpha-beta line goes through.
MESSAGE_SIZES = (64 * 1024, 16 * 2**20)


def check_output(path: str) -> None:
    """ConfigError naming plan.calibration_file when it is empty, a folder, or its folder cannot be made or written."""
    if not path:
        raise ConfigError("plan.calibration_file: empty; name the JSON file the calibration is written to")
    folder = os.path.dirname(path) or "."
    with user_input("plan.calibration_file"):
        os.makedirs(folder, exist_ok=True)
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a folder")
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"{folder} is not writable")


def overlap_fraction(compute_s: float, collective_s: float, together_s: float) -> float:
    """The fraction of the shorter of a compute and a collective that runs hidden behind the other
    when both are issued together, from the times of each alone and of both."""
    hidden = (compute_s + collective_s - together_s) / min(compute_s, collective_s)
    return min(1.0, max(0.0, hidden))


def median_seconds(run: Callable[[], Any], device: torch.device) -> float:
    """This rank's median time of ``run`` over ``REPEATS`` after ``WARMUP`` untimed runs and a barrier."""
    for _ in range(WARMUP):
        run()
    synchronize(device)
    dist.barrier()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(seconds: list[float], device: torch.device) -> list[float]:
    """Each figure's slowest rank's value: what a step waits for."""
    values = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def one_block_model(config: JobConfig, args: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The job's model with one block, in ``dtype``, its attention as training runs it on ``device``."""
    args = dataclasses.replace(args, n_layers=1)
    with torch.device("meta"):
        model = get_model_spec(config.model.name).model_cls(args)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # the rotary table in float32, as training has it
    chunk = causal_query_chunk(device.type, args.max_seq_len)
    model.configure_attention(attention_dtype(device.type, dtype, args.head_dim), chunk, document_kernel(device.type))
    return model


def training_pass(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> None:
    summed_cross_entropy(model(tokens), labels).backward()


def compute_seconds(
    config: JobConfig, args: Any, device: torch.device, dtype: torch.dtype
) -> tuple[list[float], list[float]]:
    """Per microbatch: a block's forward and backward, and the rest of a training pass's (the
    embedding, norm, output and loss: a one-block model's pass less its block's, at least 0)."""
    model = one_block_model(config, args, device, dtype)
    blocks, models = [], []
    for microbatch in MICROBATCHES:
        block, inputs, _ = fresh_block(args, microbatch, device, dtype)
        blocks.append(median_seconds(functools.partial(forward_backward, block, inputs), device))
        tokens, labels = torch.randint(args.vocab_size, (2, microbatch, args.max_seq_len), device=device)
        models.append(median_seconds(functools.partial(training_pass, model, tokens, labels), device))
    blocks = slowest(blocks, device)
    rests = [max(0.0, whole - block) for whole, block in zip(slowest(models, device), blocks)]
    return blocks, rests


def measure_overlap(args: Any, device: torch.device, dtype: torch.dtype) -> float:
    """``overlap_fraction`` of a block's forward and backward at one sequence and an asynchronous
    all-gather of its parameters (as a prefetch is issued), each rank's times the slowest rank's."""
    block, inputs, _ = fresh_block(args, 1, device, dtype)
    world_size = dist.get_world_size()
    shard_bytes = sum(p.numel() * p.element_size() for p in block.parameters()) // world_size
    shard = torch.ones(shard_bytes, dtype=torch.uint8, device=device)
    full = torch.empty(shard_bytes * world_size, dtype=torch.uint8, device=device)

    def gather() -> dist.Work:
        return dist.all_gather_single(full, shard, async_op=True)

    def both() -> None:
        work = gather()
        forward_backward(block, inputs)
        work.wait()

    alone = [
        median_seconds(lambda: forward_backward(block, inputs), device),
        median_seconds(lambda: gather().wait(), device),
    ]
    compute_s, collective_s, together_s = slowest([*alone, median_seconds(both, device)], device)
    return overlap_fraction(compute_s, collective_s, together_s)


def link_figures(model: CommModel) -> dict[str, float]:
    return {"alpha_us": model.alpha_s * 1e6, "gbps": model.bandwidth_bytes_per_s / 1e9}


def calibrate(config: JobConfig, args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The calibration file's contents; every rank measures, every rank gets the same figures."""
    block_s, rest_s = compute_seconds(config, args, device, dtype)
    world_size = dist.get_world_size()
    collectives = overlap = None
    if world_size > 1:  # one rank has no traffic to time
        collectives = {
            kind: link_figures(calibrate_collective(kind, None, device, MESSAGE_SIZES, REPEATS, WARMUP))
            for kind in COLLECTIVES
        }
        overlap = measure_overlap(args, device, dtype)
    model = config.model
    return {
        "world_size": world_size,
        "device": device.type,
        "backend": backend_for(device),
        "dtype": str(dtype).removeprefix("torch."),
        "model": {
            "name": model.name,
            "flavor": model.flavor,
            "seq_len": args.max_seq_len,
            "dim": args.dim,
            "n_layers": args.n_layers,
        },
        "compute": {"microbatches": list(MICROBATCHES), "block_seconds": block_s, "rest_seconds": rest_s},
        "collectives": collectives,
        "overlap": overlap,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def summary(calibration: dict[str, Any], path: str) -> str:
    """One line per figure."""
    model = calibration["model"]
    lines = [
        f"calibration of {model['name']} {model['flavor']} at seq {model['seq_len']} on {calibration['world_size']} "
        f"{calibration['device']} ranks ({calibration['backend']}, {calibration['dtype']}), written to {path}"
    ]
    compute = calibration["compute"]
    for name in ("block_seconds", "rest_seconds"):
        times = ", ".join(f"{mb}: {s * 1e3:.2f} ms" for mb, s in zip(compute["microbatches"], compute[name]))
        lines.append(f"{name} per microbatch: {times}")
    for kind, link in (calibration["collectives"] or {}).items():
        lines.append(f"{kind}: alpha {link['alpha_us']:.1f} us, bus bandwidth {link['gbps']:.3f} GB/s")
    if calibration["overlap"] is not None:
        lines.append(f"overlap: {calibration['overlap']:.2f} of a collective hides behind compute")
    return "\n".join(lines)


def _prepare(argv: list[str]) -> tuple[JobConfig, Any]:
    config = load_config(argv)
    check_output(config.plan.calibration_file)
    return config, job_model_args(config)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text(PROGRAM))
        return 0
    rank = int(os.environ.get("RANK", 0))
    init_console_logging()
    try:
        config, args = _prepare(argv)
    except ConfigError as e:
        if rank == 0:  # every rank finds it; one says so
            print_error(named_as_given(e, argv))
        return 2
    device = init_distributed(config.comm, config.job.dump_folder)
    config = resolve_precision(config, device.type)
    calibration = calibrate(config, args, device, getattr(torch, config.training.mixed_precision_param))
    code = 0
    if rank == 0:
        path = config.plan.calibration_file
        try:
            with user_input("plan.calibration_file"), open(path, "w", encoding="utf-8") as f:
                json.dump(calibration, f, indent=2)
            print(summary(calibration, path))
        except ConfigError as e:
            print_error(e)
            code = 2
    dist.barrier()
    dist.destroy_process_group()
    return code


def cli() -> None:
    """The ``tessera-calibrate`` command."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
