"""Runs a function on several spawned processes (gloo ranks) and never hangs the test session."""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(target: Callable[..., None], world_size: int, *args: Any, timeout_s: float) -> list[int | None]:
    """Starts ``target(rank, port, *args)`` for each rank, kills any still running after
    ``timeout_s`` and fails; returns the exit codes."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    workers = [context.Process(target=target, args=(rank, port, *args)) for rank in range(world_size)]
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
    assert not hung, f"workers did not finish within {timeout_s} s"
    return [worker.exitcode for worker in workers]
