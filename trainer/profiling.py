"""torch.profiler traces and GPU memory snapshots every few steps, and the tensors cycles hold."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
from collections.abc import Iterator
from types import ModuleType

import torch

from config.job_config import Profiling
from parallelisms.device import allocator_history, profiler_activities

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def maybe_profile(
    config: Profiling, dump_folder: str, rank: int, last_step: int
) -> Iterator[torch.profiler.profile | None]:
    """A profiler the loop steps once per step (None when off), counting from ``last_step``."""
    if not config.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(dump_folder, config.save_traces_folder)
    ending = False

    def save_trace(prof: torch.profiler.profile) -> None:
        # The profiler's exit saves its window; one whose recording begins after the last step holds none.
        freq = config.profile_freq
        if ending and prof.step_num % freq == (freq - config.profiler_active) % freq:
            return
        step_dir = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(step_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(step_dir, f"rank{rank}_trace.json"))
        logger.info("profiler trace saved to %s", step_dir)

    activities = profiler_activities()
    # Record the last profiler_active steps of each profile_freq window, after the warm-up steps.
    warmup = min(config.profiler_warmup, config.profile_freq - config.profiler_active)
    if warmup < config.profiler_warmup:
        logger.warning(
            f"profiling.profiler_warmup {config.profiler_warmup} cut to {warmup}: profile_freq "
            f"{config.profile_freq} holds {config.profiler_active} active steps"
        )
    wait = config.profile_freq - config.profiler_active - warmup
    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=config.profiler_active)
    prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=save_trace)
    # Counted from the resumed step, as torchtitan does: a resumed run's traces keep the earlier's.
    prof.step_num = last_step
    with prof:
        yield prof
        ending = True


class MemorySnapshots:
    """Saves the allocator's recorded history, ``<folder>/<name>/rank<rank>_memory_snapshot.pickle``."""

    def __init__(self, memory: ModuleType, folder: str, rank: int, freq: int, last_step: int):
        self.memory, self.folder, self.rank, self.freq = memory, folder, rank, freq
        self.last_step = last_step

    def step_done(self, step: int) -> None:
        self.last_step = step
        if step % self.freq == 0:
            self.save(f"iteration_{step}")

    def save(self, name: str) -> None:
        path = os.path.join(self.folder, name, f"rank{self.rank}_memory_snapshot.pickle")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(self.memory._snapshot(), f)
        logger.info("memory snapshot saved to %s", path)


@contextlib.contextmanager
def maybe_snapshot_memory(
    config: Profiling, dump_folder: str, rank: int, device: torch.device, last_step: int
) -> Iterator[MemorySnapshots | None]:
    """The snapshots the loop reports steps to (None when off); a step out of memory saves one more."""
    if not config.enable_memory_snapshot:
        yield None
        return
    memory = allocator_history(device)
    if memory is None:
        logger.warning(
            "profiling.enable_memory_snapshot: a %s rank's allocator keeps no history; training without snapshots",
            device.type,
        )
        yield None
        return
    folder = os.path.join(dump_folder, config.save_memory_snapshot_folder)
    memory._record_memory_history(max_entries=100_000)  # torchtitan's: a few steps of a large model
    snapshots = MemorySnapshots(memory, folder, rank, config.profile_freq, last_step)
    try:
        yield snapshots
    except torch.OutOfMemoryError:
        snapshots.save(f"iteration_{snapshots.last_step}_exit")
        raise
    finally:
        memory._record_memory_history(enabled=None)


def collect_garbage_held_by_cycles() -> None:
    """A full collection warning of the tensors reference cycles held (debug.gc_debug)."""
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept in gc.garbage
    try:
        gc.collect()
        # Bytes from the plain tensors (a DTensor's are its local tensor's), each storage once.
        storages = {
            obj.untyped_storage().data_ptr(): obj.untyped_storage().nbytes()
            for obj in gc.garbage
            if type(obj) in (torch.Tensor, torch.nn.Parameter)
        }
        tensors = sum(isinstance(obj, torch.Tensor) for obj in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    gc.collect()  # now frees them
    if tensors:
        logger.warning(
            "debug.gc_debug: reference cycles held %d tensors (%.1f MiB), freed by this collection only",
            tensors,
            sum(storages.values()) / 2**20,
        )
