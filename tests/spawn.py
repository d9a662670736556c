"""Runs a function on several spawned processes (gloo ranks) and never hangs the test session."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def spawn_ranks(target: Callable[..., None], world_size: int, *args: Any, timeout_s: float) -> list[int | None]:
    """Starts ``target(rank, init_method, *args)`` for each rank, kills any still running after
    ``timeout_s`` and fails; returns the exit codes. ``init_method`` is a file the ranks meet in
    (``dist.init_process_group``'s): a free TCP port picked here could be taken by a test running
    beside this one before rank 0 listens on it, and the other ranks would then wait until the timeout."""
    context = multiprocessing.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="spawn_ranks_")
    init_method = f"file://{os.path.join(folder, 'store')}"
    workers = [context.Process(target=target, args=(rank, init_method, *args)) for rank in range(world_size)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + timeout_s
    try:
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [worker for worker in workers if worker.is_alive()]
        for worker in hung:
            worker.kill()
            worker.join()
        shutil.rmtree(folder, ignore_errors=True)
    assert not hung, f"workers did not finish within {timeout_s} s"
    return [worker.exitcode for worker in workers]


def _gloo_rank(rank: int, init_method: str, world_size: int, check: Callable[[int], None], passed: Any) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    check(rank)
    # Report before teardown: gloo can abort a process while it exits, after all checks ran,
    # which says nothing about the code under test.
    passed[rank] = 1  # shared memory: visible at once, unlike a Queue's feeder thread
    dist.barrier()
    dist.destroy_process_group()


def check_on_gloo_ranks(check: Callable[[int], None], world_size: int, *, timeout_s: float) -> None:
    """Runs ``check(rank)`` (a module-level function) on ``world_size`` spawned ranks of one gloo
    process group; fails unless every rank got through it."""
    passed = multiprocessing.get_context("spawn").Array("i", world_size)
    exit_codes = spawn_ranks(_gloo_rank, world_size, world_size, check, passed, timeout_s=timeout_s)
    assert list(passed) == [1] * world_size, (
        f"passed per rank {list(passed)}, exit codes {exit_codes}; see the worker tracebacks above"
    )
