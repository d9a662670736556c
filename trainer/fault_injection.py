"""Failure injection for tests of restarts: ``debug.fail_at_step`` with ``debug.failure``, once, on
the first attempt's last rank. A save failure strikes once the rank's shard is (partly) on disk; a
NaN gradient reaches every rank through the global norm, so that they skip or roll back together."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from config.job_config import Debug
from trainer.checkpoint.integrity import ChecksummedWriter
from trainer.distributed import is_first_attempt

logger = logging.getLogger(__name__)

SAVE_FAILURES = ("kill_during_save", "hang_during_save", "disk_full_during_save")
DISK_ROOM = 64 * 2**10  # bytes that fit on the "full" disk before writes fail
SLOW_STEP_SECONDS = 0.5  # what debug.failure=slow adds to each of the rank's steps
STOP_AFTER_SECONDS = 1.0  # debug.failure=stop: into the step, its peers waiting on it in a collective


class _FailingWriter(ChecksummedWriter):
    """Dies (``kill_during_save``) or hangs (``hang_during_save``) once its shard is on disk."""

    def __init__(self, path: str, failure: str):
        super().__init__(path)
        self.failure = failure

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        result = super().write_data(plan, planner)
        result.wait()
        if self.failure == "kill_during_save":
            logger.warning("debug.failure=kill_during_save: killing this rank in the middle of the save")
            os.kill(os.getpid(), signal.SIGKILL)
        logger.warning("debug.failure=hang_during_save: this rank hangs in the middle of the save")
        while True:
            time.sleep(3600)


class _FullDiskStream:
    """A file on a disk with ``room[0]`` bytes left: a write that does not fit writes what fits, then raises ENOSPC."""

    def __init__(self, raw: IO[bytes], path: str, room: list[int]):
        self.raw = raw
        self.path = path
        self.room = room

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self.room[0]:
            self.raw.write(view[: self.room[0]])
            self.raw.flush()
            self.room[0] = 0
            logger.warning("debug.failure=disk_full_during_save: the disk is full while writing %s", self.path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        self.room[0] -= len(view)
        return self.raw.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _FullDisk(FileSystem):
    """The local file system with ``room`` bytes left for the files this process writes."""

    def __init__(self, room: int):
        self.room = [room]

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            yield _FullDiskStream(raw, str(path), self.room) if "w" in mode else raw


class FailureInjector:
    def __init__(self, debug: Debug, rank: int, world_size: int):
        self.debug = debug
        self.rank = rank
        self.on_this_rank = rank == world_size - 1
        self.pending = debug.fail_at_step >= 0 and is_first_attempt()
        self.poison_gradients = False

    def before_step(self, step: int) -> None:
        """Kills, stops or hangs this rank, or arms ``poison``, when ``step`` is the failing step; slows
        each step from it on (the rank does more than its peers, as a slower device would)."""
        if self.debug.failure == "slow" and self.on_this_rank and self.pending and step >= self.debug.fail_at_step:
            time.sleep(SLOW_STEP_SECONDS)
            return
        if not self.pending or step != self.debug.fail_at_step:
            return
        self.pending = False
        failure = self.debug.failure
        if not self.on_this_rank or failure in SAVE_FAILURES:
            return
        if failure == "nan":
            self.poison_gradients = True
            return
        logger.warning("debug.fail_at_step=%d: injecting '%s' on rank %d", step, failure, self.rank)
        if failure == "stop":
            time.sleep(STOP_AFTER_SECONDS)
        if failure in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if failure == "kill" else signal.SIGSTOP)
        if failure == "oom":
            raise torch.OutOfMemoryError(f"debug.failure=oom injected on rank {self.rank}")
        while failure == "hang":
            time.sleep(3600)

    def poison(self, params: list[torch.Tensor]) -> None:
        """Makes the first gradient NaN when armed by ``before_step``."""
        if self.poison_gradients:
            self.poison_gradients = False
            params[0].grad.fill_(math.nan)

    def storage_writer(self, step: int, path: str) -> FileSystemWriter:
        """The checkpoint writer for ``step``: one that dies, hangs or fills the disk when asked to."""
        failure = self.debug.failure
        armed = step == self.debug.fail_at_step and self.on_this_rank and is_first_attempt()
        if failure not in SAVE_FAILURES or not armed:
            return ChecksummedWriter(path)
        if failure == "disk_full_during_save":
            return ChecksummedWriter(path, file_system=_FullDisk(DISK_ROOM))
        return _FailingWriter(path, failure)
