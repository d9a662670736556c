"""trainer/profiling.py: which steps the traces record."""

from __future__ import annotations

import collections
import json
import os

import torch

from config.job_config import Profiling
from trainer.profiling import maybe_profile


def _recorded_steps(tmp_path, steps: int, **options) -> dict[str, list[int]]:
    """Runs ``steps`` tiny steps under the profiler; returns each trace folder's recorded steps
    (counted from 1, as the trainer counts them)."""
    config = Profiling(enable_profiling=True, **options)
    with maybe_profile(config, str(tmp_path), rank=0) as profiler:
        for _ in range(steps):
            torch.ones(8, 8) @ torch.ones(8, 8)
            profiler.step()
    recorded = {}
    for folder in sorted(os.listdir(tmp_path / "profile_traces")):
        with open(tmp_path / "profile_traces" / folder / "rank0_trace.json") as f:
            names = collections.Counter(e.get("name", "") for e in json.load(f)["traceEvents"] if e.get("ph") == "X")
        recorded[folder] = sorted(int(name.split("#")[1]) + 1 for name in names if name.startswith("ProfilerStep#"))
    return recorded


def test_each_window_records_its_last_active_steps(tmp_path):
    """torchtitan's profiler_active and profiler_warmup: every profile_freq steps, the last
    profiler_active of them recorded."""
    assert _recorded_steps(tmp_path / "two", 8, profile_freq=4, profiler_active=2, profiler_warmup=1) == {
        "iteration_4": [3, 4],
        "iteration_8": [7, 8],
    }
    # The defaults: one step a window; a warm-up longer than the window leaves is cut to fit.
    assert _recorded_steps(tmp_path / "one", 4, profile_freq=2) == {"iteration_2": [2], "iteration_4": [4]}
