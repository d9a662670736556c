"""The device-specific choices of parallelisms/device.py, as they fall on this machine (a CPU
without accelerators) and, where they do not need one, as they fall on CUDA.
tests/distributed/test_cuda.py runs the CUDA side on a machine that has GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers the "fake" backend)

from parallelisms import device as dev
from tests.launch import NO_MEMORY_CGROUP, REPO, enter_cgroup, limited_memory_cgroup

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
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        dev.use_deterministic_algorithms(warn_only=True)  # debug.deterministic_warn_only, as torchtitan
        assert torch.is_deterministic_algorithms_warn_only_enabled()
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


# Run in a fresh interpreter: malloc's settings are the whole process's. Prints what
# cache_freed_host_memory returned and the page faults of the last of ten 64 MiB buffers, each
# filled and freed in turn, as a training step's buffers are: the heap needs a few rounds to settle
# (each aligned block leaves a small chunk behind that keeps it from merging at first).
_REFILL = """
import resource, sys, torch
from parallelisms.device import cache_freed_host_memory
applied = cache_freed_host_memory(torch.device(sys.argv[1]))
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults)
"""
PAGES_OF_64_MIB = 64 * 2**20 // 4096


def _refill(device: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in dev._MALLOC_TUNING}
    out = subprocess.run(
        [sys.executable, "-c", _REFILL, device],
        env={**clean, "PYTHONPATH": REPO, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


def test_freed_host_memory_is_reused_without_page_faults():
    # Kept: the last buffer reuses an earlier one's pages. Default malloc: it maps fresh pages and
    # faults every one of them in.
    applied, faults = _refill("cpu")
    assert applied == "True" and faults < PAGES_OF_64_MIB // 10
    applied, faults = _refill("cpu", MALLOC_TRIM_THRESHOLD_="131072")  # a user's own tuning wins
    assert applied == "False" and faults > PAGES_OF_64_MIB // 2
    assert _refill("meta")[0] == "False"  # an accelerator's memory is its allocator's business


def test_a_cpu_rank_has_its_share_of_its_cgroups_memory_limit():
    """In a memory cgroup of 3 GiB (a batch scheduler's job, on a host with more), two CPU ranks have
    1.5 GiB each: the limit is read from the process's own cgroup (v1 or v2), not only from the
    root of cgroup v2's hierarchy, which a job's limit is not."""
    cgroup = limited_memory_cgroup(3 * 2**30)
    if cgroup is None:
        pytest.skip(NO_MEMORY_CGROUP)
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "from parallelisms.device import memory_per_rank; print(*memory_per_rank(2), sep='|')",
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=lambda: enter_cgroup(cgroup),
        ).stdout
    finally:
        os.rmdir(cgroup)
    available, source = out.strip().split("|")
    assert int(available) == 3 * 2**30 // 2, out
    assert source == "3.0 GiB of host memory for 2 ranks"
