"""torch.profiler traces every few steps, written under the dump folder."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from config.job_config import Profiling
from parallelisms.device import profiler_activities

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def maybe_profile(config: Profiling, dump_folder: str, rank: int) -> Iterator[torch.profiler.profile | None]:
    """Yields a profiler whose ``step()`` the loop calls once per step, or None when disabled."""
    if not config.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(dump_folder, config.save_traces_folder)

    def save_trace(prof: torch.profiler.profile) -> None:
        step_dir = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(step_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(step_dir, f"rank{rank}_trace.json"))
        logger.info("profiler trace saved to %s", step_dir)

    activities = profiler_activities()
    # Record the last profiler_active steps of each profile_freq window, after the warm-up steps.
    warmup = min(config.profiler_warmup, config.profile_freq - config.profiler_active)
    if warmup < config.profiler_warmup:
        logger.warning(
            "profiling.profiler_warmup %d cut to %d: profile_freq %d holds %d active steps",
            config.profiler_warmup,
            warmup,
            config.profile_freq,
            config.profiler_active,
        )
    wait = config.profile_freq - config.profiler_active - warmup
    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=config.profiler_active)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=save_trace) as prof:
        yield prof
