"""A real run's tracked peak memory, measured as the dry run measures its estimate.

    python -m torch.distributed.run --standalone --nproc-per-node N bench/memory_worker.py OUT.json [--rank R] [config options]
    python bench/memory_worker.py OUT.json [--rank R] --fake N [config options]

Real (under torchrun, gloo, CPU): builds the config's model, optimizer and LR schedule on the ranks
and runs ``programs.dry_run.measure_steps`` (two training steps on random tokens, MemTracker over
the second); rank R (0 by default) writes ``{"peak": bytes by MemTracker category and "Total",
"seconds": ...}`` to OUT.json.
``--fake N``: the dry run of the same config as rank R of N fake ranks, its peak written the same
way, with the dry run's whole report under "report". Used by ``bench/estimate_accuracy.py`` and ``tests/unit/test_dry_run.py``.

Attention computes in the compute dtype, as on the GPUs a dry run stands for (on a CPU, heads
narrower than 64 would attend in float32 under bf16, holding float32 copies the GPU does not).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from config.manager import load_config
from config.rules import batch_layout
from models.builder import build_model
from models.llama3.model import Attention
from models.sizes import model_args
from programs.dry_run import dry_run, measure_steps
from train import exit_without_teardown
from trainer.distributed import parallel_dims_from_config
from trainer.loss import Loss
from trainer.optim import build_optimizer_and_schedule


def _let_gloo_release_finished_work() -> None:
    """Every ``Work.wait`` then yields the CPU for 2 ms. Gloo's worker thread wakes the waiter as a
    collective completes and only then drops its hold on the collective's tensors; on a loaded host
    the waiter can run on and allocate first, putting buffers the program has freed on the tracked
    peak (seen on the pipeline layout: 1 run in 9 to 12, 3.2-5.9% over, at 12-16 ranks on 2 cores)."""
    work_type = torch._C._distributed_c10d.Work
    wait = work_type.wait

    def wait_then_yield(work, *args, **kwargs):
        result = wait(work, *args, **kwargs)
        time.sleep(0.002)
        return result

    work_type.wait = wait_then_yield


def real_peak(argv: list[str]) -> dict[str, int]:
    _let_gloo_release_finished_work()
    dist.init_process_group("gloo")
    config = load_config(argv)
    dims = parallel_dims_from_config(config.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    global_batch, accumulation = batch_layout(config.training, dims.dp_degree)
    loss = Loss(global_batch * config.training.seq_len, dims, config.compile, config.parallelism.enable_loss_parallel)
    args = model_args(config)
    built = build_model(config, dims, torch.device("cpu"), args, loss)
    for part in built.parts:
        for module in part.modules():
            if isinstance(module, Attention):
                module.attention_dtype = None
    optimizer, schedule = build_optimizer_and_schedule(
        config.optimizer, config.lr_scheduler, config.training, built.parts
    )
    shape = (config.training.local_batch_size, config.training.seq_len)
    peak, _, _ = measure_steps(
        built,
        loss,
        optimizer,
        schedule,
        lambda: (torch.randint(args.vocab_size, shape), torch.randint(args.vocab_size, shape)),
        accumulation,
        dims,
    )
    dist.destroy_process_group()
    return peak


def fake_peak(world_size: int, rank: int, argv: list[str]) -> tuple[dict[str, int], dict]:
    """The dry run's peak by category and "Total", and its whole report."""
    report = dry_run(load_config(argv), world_size, rank)
    return {**report.peak, "Total": report.peak_bytes}, dataclasses.asdict(report)


def main(argv: list[str]) -> int:
    out, argv = argv[0], argv[1:]
    rank, argv = (int(argv[1]), argv[2:]) if argv[:1] == ["--rank"] else (0, argv)
    fake = argv[:1] == ["--fake"]
    start = time.perf_counter()
    report = None
    if fake:
        peak, report = fake_peak(int(argv[1]), rank, argv[2:])
    else:
        peak = real_peak(argv)
    if fake or int(os.environ.get("RANK", "0")) == rank:
        with open(out, "w") as f:
            json.dump({"peak": peak, "seconds": time.perf_counter() - start, "report": report}, f)
    exit_without_teardown(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
