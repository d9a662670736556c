"""trainer/profiling.py: which steps the traces record, and when memory snapshots are saved."""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle

import pytest
import torch

from config.job_config import Profiling
from trainer import profiling
from trainer.profiling import maybe_profile, maybe_snapshot_memory


def _recorded_steps(tmp_path, steps: int, last_step: int = 0, **options) -> dict[str, list[int]]:
    """Runs ``steps`` tiny steps under the profiler, after ``last_step``; returns each trace
    folder's recorded steps (counted from 1, as the trainer counts them)."""
    config = Profiling(enable_profiling=True, **options)
    with maybe_profile(config, str(tmp_path), rank=0, last_step=last_step) as profiler:
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
    # A run that ends as a window's recording begins saves no trace of it (it saved one holding
    # no step, under the last step's name); one that ends within the recording keeps its steps.
    options = dict(profile_freq=4, profiler_active=2, profiler_warmup=1)
    assert _recorded_steps(tmp_path / "ends_as_one_begins", 6, **options) == {"iteration_4": [3, 4]}
    assert _recorded_steps(tmp_path / "ends_within", 7, **options) == {"iteration_4": [3, 4], "iteration_7": [7, 8]}
    # The defaults: one step a window; a warm-up longer than the window leaves is cut to fit.
    assert _recorded_steps(tmp_path / "one", 4, profile_freq=2) == {"iteration_2": [2], "iteration_4": [4]}


def test_a_resumed_run_profiles_the_steps_it_is_at(tmp_path):
    """Resumed after step 4 (and 5), the windows and trace names count the run's steps, as
    torchtitan's do: from step 0, they recorded steps 7-8 as iteration_4, in place of the trace the
    run before the resume had saved under that name."""
    options = dict(profile_freq=4, profiler_active=2, profiler_warmup=1)
    assert _recorded_steps(tmp_path / "at4", 4, last_step=4, **options) == {"iteration_8": [7, 8]}
    assert _recorded_steps(tmp_path / "at5", 5, last_step=5, **options) == {"iteration_8": [7, 8]}


def test_the_last_steps_trace_is_kept_when_every_step_is_recorded(tmp_path):
    """A window that records from its first step (profile_freq = profiler_active): the profiler's
    exit saves the window begun after the last step, which holds no step; it replaced the last
    step's trace under the same name."""
    assert _recorded_steps(tmp_path / "every", 3, profile_freq=1) == {
        "iteration_1": [1],
        "iteration_2": [2],
        "iteration_3": [3],
    }
    assert _recorded_steps(tmp_path / "pairs", 4, profile_freq=2, profiler_active=2) == {
        "iteration_2": [1, 2],
        "iteration_4": [3, 4],
    }


class _RecordingAllocator:
    """Stands for torch.cuda.memory: the history switch and what a snapshot holds."""

    def __init__(self):
        self.history: list = []

    def _record_memory_history(self, enabled="all", max_entries=1):
        self.history.append(enabled)

    def _snapshot(self):
        return {"segments": [], "recording": self.history[-1]}


def test_memory_snapshots_every_profile_freq_steps_and_at_out_of_memory(tmp_path, monkeypatch):
    allocator = _RecordingAllocator()
    monkeypatch.setattr(profiling, "allocator_history", lambda device: allocator)
    config = Profiling(enable_memory_snapshot=True, profile_freq=2)
    with pytest.raises(torch.OutOfMemoryError):
        with maybe_snapshot_memory(config, str(tmp_path), 3, torch.device("cuda"), last_step=10) as snapshots:
            for step in range(11, 16):
                snapshots.step_done(step)
            raise torch.OutOfMemoryError("step 16")
    folder = tmp_path / "memory_snapshot"
    assert sorted(os.listdir(folder)) == ["iteration_12", "iteration_14", "iteration_15_exit"]
    with open(folder / "iteration_15_exit" / "rank3_memory_snapshot.pickle", "rb") as f:
        assert pickle.load(f) == {"segments": [], "recording": "all"}
    assert allocator.history == ["all", None]  # recording stops with the loop


def test_a_cpu_rank_trains_without_memory_snapshots_and_says_so(tmp_path, caplog):
    config = Profiling(enable_memory_snapshot=True)
    with caplog.at_level(logging.WARNING), maybe_snapshot_memory(config, str(tmp_path), 0, torch.device("cpu"), 0) as s:
        assert s is None
    assert "profiling.enable_memory_snapshot: a cpu rank's allocator keeps no history" in caplog.text
    assert os.listdir(tmp_path) == []
