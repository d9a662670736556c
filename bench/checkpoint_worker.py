"""torchrun worker of ``bench/checkpoint.py``: times the trainer's checkpoint saves and loads.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/checkpoint_worker.py \\
        --root DIR --out RESULT.json --repeats 3 -- --model.flavor debugmodel ...

Builds a ``Trainer`` from ``configs/debug_model.toml`` plus the overrides (FSDP2 by default), runs
one training step so that the optimizer state exists, then per repetition, each in a folder of its
own: a synchronous save; an async save (blocked: ``save()``, then the wait for the state copy left
after the next forward and backward; total: from ``save()`` until written, that forward and
backward included); a resume of the synchronous checkpoint into a freshly built trainer at the
same layout, and one at a tensor-parallel layout (TP 2 instead of FSDP 2: every tensor resharded).
Each time is the slowest rank's, since the next collective waits for it. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from config.manager import load_config
from train import exit_without_teardown
from trainer.checkpoint.manager import CheckpointManager
from trainer.trainer import Trainer

BASE_CONFIG = os.path.join(REPO, "configs", "debug_model.toml")
TP2 = "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1".split()


def slowest(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, started together on all ranks, on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


@torch.no_grad()
def weight_norm(trainer: Trainer) -> float:
    """Global norm of the model's weights, the same at any layout: checks that a load happened."""
    total = sum(p.full_tensor().double().pow(2).sum() for part in trainer.model.parts for p in part.parameters())
    return float(total) ** 0.5


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def timed_resume(config_args: list[str], folder: str, expected_norm: float) -> float:
    """Resume time of a freshly built trainer (its optimizer state is created by the load, as in a
    real restart) from the checkpoint in ``folder``."""
    fresh = Trainer(load_config(config_args))
    fresh.checkpointer.folder = folder
    seconds = slowest(fresh.checkpointer.resume)
    norm = weight_norm(fresh)
    if fresh.step != 1 or abs(norm - expected_norm) > 1e-6 * expected_norm:
        raise RuntimeError(f"load from {folder} restored step {fresh.step}, weight norm {norm} != {expected_norm}")
    fresh.checkpointer.close()
    fresh.metrics.close()
    del fresh
    gc.collect()
    return seconds


def run(root: str, out: str, repeats: int, overrides: list[str]) -> None:
    # --metrics.peak_flops: no MFU here, which skips the matmul benchmark.
    flags = f"--job.config_file {BASE_CONFIG} --job.dump_folder {os.path.join(root, 'dump')} --checkpoint.enable"
    config_args = [*flags.split(), *"--metrics.enable_tensorboard false --metrics.peak_flops 1e12".split(), *overrides]
    trainer = Trainer(load_config(config_args))
    batches = iter(trainer.dataloader)
    trainer.train_step([next(batches) for _ in range(trainer.grad_accum_steps)])
    batch = next(batches)
    trainer.step = 1
    norm = weight_norm(trainer)
    sync = trainer.checkpointer
    # A second manager over the same states, saving in the background.
    async_config = dataclasses.replace(trainer.config.checkpoint, async_mode="async")
    background = CheckpointManager(
        async_config,
        trainer.config.job.dump_folder,
        sync.resolved_config,
        model_parts=trainer.model.parts,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.lr_scheduler,
        dataloader=trainer.dataloader,
        train_state=sync.states["train_state"],
    )

    # Untimed first saves: one-time costs (the stager allocates its staging copy on the first one).
    for name, manager in (("warmup-sync", sync), ("warmup-async", background)):
        manager.folder = os.path.join(root, name)
        manager.write(1)
        manager.wait()

    times: dict[str, list[float]] = {k: [] for k in ("sync_save", "async_blocked", "async_total", "load", "load_tp2")}
    for i in range(repeats):
        sync.folder = os.path.join(root, f"sync-{i}")
        times["sync_save"].append(slowest(lambda: sync.write(1)))
        background.folder = os.path.join(root, f"async-{i}")
        blocked = slowest(lambda: background.write(1))
        # Training goes on with the next forward and backward while the state is copied; only the
        # update after them waits for the copy. (Gradients only: the weights stay those saved.)
        compute = slowest(lambda: trainer.forward_backward(batch))
        blocked += slowest(background.wait_for_staging)
        times["async_blocked"].append(blocked)
        times["async_total"].append(blocked + compute + slowest(background.wait))
        times["load"].append(timed_resume(config_args, sync.folder, norm))
        times["load_tp2"].append(timed_resume([*config_args, *TP2], sync.folder, norm))

    background.close()
    trainer.close()
    if dist.get_rank() == 0:
        result = {
            "world_size": dist.get_world_size(),
            "params": sum(p.numel() for part in trainer.model.parts for p in part.parameters()),
            "checkpoint_bytes": folder_bytes(os.path.join(root, "sync-0", "step-1")),
            "times_s": times,
        }
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="folder for the checkpoints (shared by the ranks)")
    parser.add_argument("--out", required=True, help="result JSON written by rank 0")
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then train.py config overrides")
    args = parser.parse_args()
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    run(args.root, args.out, args.repeats, overrides)
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
