"""Failure injection for tests of restarts: ``debug.fail_at_step`` with ``debug.failure``.

It acts once, at that step, on the first attempt only (before any torchrun restart), on the last
rank: ``kill`` (SIGKILL), ``hang`` (sleep forever), ``kill_during_save`` (die once its shard of
that step's checkpoint is on disk) or ``nan`` (non-finite gradients, which every rank then sees
in the global norm, so that they skip or roll back together).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from config.job_config import Debug

logger = logging.getLogger(__name__)


def is_first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class _DyingWriter(FileSystemWriter):
    def write_data(self, plan: SavePlan, planner: SavePlanner):
        result = super().write_data(plan, planner)
        result.wait()
        logger.warning("debug.failure=kill_during_save: killing this rank in the middle of the save")
        os.kill(os.getpid(), signal.SIGKILL)
        return result


class FailureInjector:
    def __init__(self, debug: Debug, rank: int, world_size: int):
        self.debug = debug
        self.rank = rank
        self.on_this_rank = rank == world_size - 1
        self.pending = debug.fail_at_step >= 0 and is_first_attempt()
        self.poison_gradients = False

    def before_step(self, step: int) -> None:
        """Kills or hangs this rank, or arms ``poison``, when ``step`` is the failing step."""
        if not self.pending or step != self.debug.fail_at_step:
            return
        self.pending = False
        failure = self.debug.failure
        if not self.on_this_rank or failure == "kill_during_save":
            return
        if failure == "nan":
            self.poison_gradients = True
            return
        logger.warning("debug.fail_at_step=%d: injecting '%s' on rank %d", step, failure, self.rank)
        if failure == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while failure == "hang":
            time.sleep(3600)

    def poison(self, params: list[torch.Tensor]) -> None:
        """Makes the first gradient NaN when armed by ``before_step``."""
        if self.poison_gradients:
            self.poison_gradients = False
            params[0].grad.fill_(math.nan)

    def storage_writer(self, step: int, path: str) -> FileSystemWriter:
        """The checkpoint writer for step ``step``: one that dies mid-save when asked to."""
        dying = self.debug.failure == "kill_during_save" and step == self.debug.fail_at_step
        if dying and self.on_this_rank and is_first_attempt():
            return _DyingWriter(path)
        return FileSystemWriter(path)
