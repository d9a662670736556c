"""The device-specific choices of parallelisms/device.py, as they fall on this machine (a CPU
without accelerators) and, where they do not need one, as they fall on CUDA.
tests/distributed/test_cuda.py runs the CUDA side on a machine that has GPUs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers the "fake" backend)

from parallelisms import device as dev

no_accelerator = pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only branches")


@no_accelerator
def test_cpu_rank_device_and_backend():
    assert dev.accelerator_count() == 0
    assert dev.device_type() == "cpu"
    # Every rank of a CPU node computes on the one CPU device, whatever its local rank.
    assert dev.rank_device(0) == dev.rank_device(3) == torch.device("cpu")
    assert dev.backend_for(torch.device("cpu")) == "gloo"


def test_nccl_is_the_backend_of_cuda_devices():
    # torch's default, known without a GPU: what a CUDA run's process group uses.
    assert dev.backend_for(torch.device("cuda", 0)) == "nccl"


def test_async_tp_only_on_cuda():
    assert dev.supports_async_tp("cuda")
    assert not dev.supports_async_tp("cpu")
    assert not dev.supports_async_tp("xpu")


@no_accelerator
def test_no_pinned_staging_and_no_cuda_profiling_without_an_accelerator():
    assert not dev.pinned_memory_available()
    assert dev.profiler_activities() == [torch.profiler.ProfilerActivity.CPU]


def test_deterministic_algorithms_with_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    try:
        torch.backends.cudnn.benchmark = True
        dev.use_deterministic_algorithms()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def test_reduce_scatter_as_all_to_all_only_on_gloo():
    # The decision asks the group's own backend: gloo's reduce-scatter is an all-reduce of a copy.
    # Any other backend keeps its reduce-scatter; torch's test backend "fake" stands in for NCCL.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dev.reduce_scatter_as_all_to_all(dist.group.WORLD, torch.device("cpu"))
        fake = dist.new_group(backend="fake", pg_options=None)
        assert not dev.reduce_scatter_as_all_to_all(fake, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
