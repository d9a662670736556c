"""Runs a function on several spawned processes (gloo ranks) and never hangs the test session."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any


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
