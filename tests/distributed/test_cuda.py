"""The branches only a CUDA machine takes (listed in parallelisms/device.py and the README), run
where there is a GPU, with no edit: the device and NCCL, the peak FLOPs lookup, async TP's
condition, pinned-memory staging, memory statistics and CUDA profiling, train.py on one GPU with a
pinned asynchronous checkpoint and memory snapshots, and FSDP2 on two GPUs against one. Skipped
without CUDA; the CPU side of the same functions is tests/unit/test_device.py."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from parallelisms import device as dev
from tests.launch import launch_train, losses, read_metrics

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the CUDA + NCCL branches (torch.cuda.is_available() is False)"
)

MIB = 2**20
# On GPUs the debug run is not bitwise reproducible (atomics in some kernels), so it is run
# without --debug.deterministic and checked to a tolerance instead.
NOT_BITWISE = ["--debug.deterministic", "false", "--training.global_batch_size", "8"]


def test_device_choice_and_nccl():
    assert dev.accelerator_count() == torch.cuda.device_count() >= 1
    assert dev.device_type() == "cuda"
    last = torch.cuda.device_count() - 1
    assert dev.rank_device(last) == torch.device("cuda", last)
    assert torch.cuda.current_device() == last  # the rank's GPU is made the current one
    assert dev.rank_device(0) == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    assert dev.backend_for(torch.device("cuda", 0)) == "nccl"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peak_flops_of_this_gpu(dtype):
    name = torch.cuda.get_device_name(0)
    peak = dev.device_peak(torch.device("cuda", 0), dtype)
    assert peak is not None and peak.flops > 0
    known = dev._known_gpu_peak(name)
    if known is None:  # an unknown GPU: a matmul benchmark
        assert peak.source.startswith("measured:"), peak.source
    elif dtype == torch.bfloat16:
        assert (peak.flops, peak.source) == (known.bf16, f"datasheet: {name}, bfloat16 dense")
    else:
        assert peak.flops in (known.fp32, known.bf16 / 2)  # plain fp32, or TF32 when it is on
        assert peak.source.startswith(f"datasheet: {name}")


def test_async_tp_pinned_staging_and_cuda_profiling_are_on():
    assert dev.supports_async_tp("cuda")
    assert dev.pinned_memory_available()
    assert torch.profiler.ProfilerActivity.CUDA in dev.profiler_activities()


def test_memory_statistics_are_the_allocators():
    device = torch.device("cuda", 0)
    torch.cuda.synchronize(device)
    dev.reset_peak_memory(device)
    base = dev.peak_memory_bytes(device)
    block = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    assert dev.peak_memory_bytes(device) >= base + 64 * MIB
    del block
    dev.reset_peak_memory(device)
    assert dev.peak_memory_bytes(device) < base + 64 * MIB


def _one_gpu_run(dump: str) -> tuple[list[dict], str]:
    result = launch_train(
        dump,
        1,
        "--training.local_batch_size",
        "8",
        *NOT_BITWISE,
        "--checkpoint.enable",
        "--checkpoint.async_mode",
        "async_with_pinned_mem",
        "--checkpoint.interval",
        "5",
        "--profiling.enable_memory_snapshot",
        "--profiling.profile_freq",
        "5",
    )
    return read_metrics(dump), result.stdout + result.stderr


@pytest.mark.slow  # launches train.py
def test_train_py_on_gpus(tmp_path):
    """One GPU: an NCCL group of one, GPU memory in the metrics, an asynchronous checkpoint staged
    in pinned memory, and the allocator's memory snapshots. Two GPUs when there are: FSDP2 gives
    the one-GPU losses."""
    one_gpu, output = _one_gpu_run(str(tmp_path / "one"))
    assert "process group: nccl backend, world size 1, device type cuda" in output
    assert "staging in ordinary memory" not in output  # pinned staging was not turned off
    for step in (5, 10):
        assert os.path.isfile(tmp_path / "one" / "checkpoint" / f"step-{step}" / "checkpoint_complete.json")
        snapshot = tmp_path / "one" / "memory_snapshot" / f"iteration_{step}" / "rank0_memory_snapshot.pickle"
        with open(snapshot, "rb") as f:
            assert pickle.load(f)["segments"]  # the allocator's memory, as pytorch.org/memory_viz reads it
    assert len(one_gpu) == 10 and losses(one_gpu)[-1] < losses(one_gpu)[0]
    assert all(0 < r["memory_gib"] < 0.9 * torch.cuda.get_device_properties(0).total_memory / 2**30 for r in one_gpu)
    if torch.cuda.device_count() < 2:
        pytest.skip("FSDP2 on two GPUs needs two GPUs; the one-GPU checks passed")
    two = str(tmp_path / "two")
    output = launch_train(two, 2, "--training.local_batch_size", "4", *NOT_BITWISE)
    assert "process group: nccl backend, world size 2, device type cuda" in output.stdout + output.stderr
    assert losses(read_metrics(two)) == pytest.approx(losses(one_gpu), rel=1e-4, abs=0)
