"""The device a rank computes on, and what it can do: every device-specific choice is a function
here, so that the same code runs on CUDA + NCCL and on CPU + gloo (docs/parallelisms.md lists them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import resource
import sys
import time
import types
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def accelerator_count() -> int:
    """The accelerators this process sees, 0 without any."""
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def device_type() -> str:
    """The accelerator's type when there is one (cuda, xpu, ...), otherwise cpu."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


def memory_per_rank(ranks_per_node: int) -> tuple[int, str]:
    """Bytes of memory one rank can have, and where they come from (for a message): its accelerator's
    total, or on a CPU the host's memory (or its cgroup's limit) shared by the node's ranks."""
    if torch.accelerator.is_available():
        total = torch.accelerator.get_memory_info(0)[1]
        return total, f"a {device_type()} device has {total / 2**30:.1f} GiB"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    total = min(total, _cgroup_memory_limit() or total)
    ranks = f"{ranks_per_node} ranks" if ranks_per_node > 1 else "1 rank"
    return total // ranks_per_node, f"{total / 2**30:.1f} GiB of host memory for {ranks}"


def memory_cgroup() -> tuple[str, str]:
    """This process's memory cgroup: its folder and its limit's file name (cgroup v1, else v2)."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    v1 = next((path for _, controllers, path in entries if "memory" in controllers.split(",")), None)
    if v1 is not None:
        return "/sys/fs/cgroup/memory" + v1, "memory.limit_in_bytes"
    return "/sys/fs/cgroup" + next((path for _, c, path in entries if c == ""), "/"), "memory.max"


def _cgroup_memory_limit() -> int | None:
    """The lowest memory limit of this cgroup and those above it (a scheduler's job, a container)."""
    try:
        folder, limit_file = memory_cgroup()
    except OSError:  # not Linux
        return None
    limits = []
    while folder.startswith("/sys/fs/cgroup"):
        try:
            with open(os.path.join(folder, limit_file)) as f:
                limits.append(int(f.read()))
        except (OSError, ValueError):  # "max", or a folder this process cannot see
            pass
        folder = os.path.dirname(folder)
    return min(limits, default=None)


def rank_device(local_rank: int) -> torch.device:
    """This local rank's accelerator, made the current one, or the CPU (shared by the node's ranks)."""
    dev_type = device_type()
    if dev_type == "cpu":
        return torch.device("cpu")
    torch.accelerator.set_device_index(local_rank)
    return torch.device(dev_type, local_rank)


def backend_for(device: torch.device) -> str:
    """The process group backend for ``device``: torch's default, nccl on CUDA and gloo on a CPU."""
    return dist.get_default_backend_for_device(torch.device(device))


def _on_gloo(group: dist.ProcessGroup, device: torch.device) -> bool:
    return isinstance(group._get_backend(torch.device(device)), dist.ProcessGroupGloo)


def reduce_scatter_as_all_to_all(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether a sum reduce-scatter should run as an all-to-all of chunks and a sum: on gloo, whose
    reduce-scatter all-reduces a fresh copy of its input (torch 2.13), twice the bytes."""
    return _on_gloo(group, device)


def all_gather_as_broadcasts(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether an all-gather should run as one broadcast per rank into its slot: on gloo, whose
    all-gather of a large bucket takes twice as long (bench/gloo_collectives.py)."""
    return _on_gloo(group, device)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Gathers every rank's ``shard`` into ``output`` in rank order and waits."""
    if not all_gather_as_broadcasts(group, output.device):
        dist.all_gather_into_tensor(output, shard, group=group)
        return
    slots = output.chunk(group.size())
    own = slots[group.rank()]
    if own.data_ptr() != shard.data_ptr():  # FSDP2 hands over its shard in place already
        own.copy_(shard)
    works = [dist.broadcast(slot, group_src=src, group=group, async_op=True) for src, slot in enumerate(slots)]
    for work in works:
        work.wait()


def supports_async_tp(device_type: str) -> bool:
    """Asynchronous tensor parallel needs CUDA's symmetric-memory collectives."""
    return device_type == "cuda"


def float8_matmuls(device_type: str) -> bool:
    """Whether torch._scaled_mm runs here: GPUs of compute capability 8.9 and up (AMD's report 9.4),
    and CPUs (a correct, slow kernel)."""
    if device_type == "cuda":
        return torch.cuda.get_device_capability() >= (8, 9)
    return device_type == "cpu"


def fast_bfloat16(device_type: str) -> tuple[bool, str]:
    """Whether bf16 matmuls beat fp32 here, and why: on GPUs that support bf16, and on CPUs with
    AVX512-BF16 or AMX (elsewhere bf16 is emulated)."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(), "CUDA"
    if device_type == "cpu":
        # torch exposes the CPU's instruction sets only under private names; absent ones count as no.
        features = {
            "AMX": getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)(),
            "AVX512-BF16": getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)(),
        }
        found = [name for name, present in features.items() if present]
        return bool(found), f"CPU with {' and '.join(found)}" if found else "CPU without bf16 instructions"
    return False, device_type


def attention_dtype(device_type: str, compute_dtype: torch.dtype, head_dim: int) -> torch.dtype | None:
    """The dtype attention should run in when not ``compute_dtype``, else None. torch's CPU flash
    attention runs the backward of bf16 heads narrower than 64 slower than in float32 (1.67x at
    head_dim 16, 1.18x at 32, one thread, seq 512), and the casts cost little."""
    if device_type == "cpu" and compute_dtype == torch.bfloat16 and head_dim < 64:
        return torch.float32
    return None


def causal_query_chunk(device_type: str, seq_len: int) -> int | None:
    """Rows of queries per call of causal attention when splitting them up is faster, else None.
    torch's CPU flash attention skips only whole 512-key blocks, so up to 512 tokens half its work
    is masked away; chunks of 128 queries took 0.74x the time at 512 and 0.92x at 256, but not
    less from 1024 on (bench/cpu_attention.py). GPU kernels skip per tile."""
    if device_type == "cpu" and 128 < seq_len <= 512:
        return 128
    return None


DocumentKernel = Literal["sdpa", "flex"]


def document_kernel(device_type: str) -> DocumentKernel:
    """How attention keeps packed documents apart on ``device_type``. On CUDA, flex attention with a
    block mask, whose kernel skips the blocks between documents. Elsewhere, SDPA with a boolean
    block-diagonal causal mask: torch 2.13's flex attention has no CPU backward."""
    return "flex" if device_type == "cuda" else "sdpa"


def pinned_memory_available() -> bool:
    """Whether pinned host memory helps: only copies from an accelerator use it."""
    return torch.accelerator.is_available()


# glibc's mallopt parameters, and the variables by which a user tunes or replaces malloc.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_MALLOC_TUNING = (
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)


def cache_freed_host_memory(device: torch.device) -> bool:
    """On a CPU, makes glibc's malloc keep freed tensors' memory for the next ones, as CUDA's caching
    allocator does: otherwise every buffer over 32 MiB is a fresh mmap faulted in page by page each
    step. The heap keeps its high-water mark. Left alone where the user tuned or replaced malloc, and
    off glibc. Returns whether malloc now keeps freed memory."""
    if torch.device(device).type != "cpu" or any(os.environ.get(name) for name in _MALLOC_TUNING):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt, _ = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return False  # not glibc: another malloc, with its own policy
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since ``reset_peak_memory``: the CUDA allocator's, else this process's peak RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux but in bytes on macOS.
    return max_rss if sys.platform == "darwin" else max_rss * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak-memory window (on a CPU, Linux only; elsewhere the peak is the process's)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Linux resets the RSS high-water mark when "5" is written here.
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        logger.debug("Cannot reset the peak RSS; CPU peak memory is the process lifetime peak")


def profiler_activities() -> list[torch.profiler.ProfilerActivity]:
    """CPU operators, plus CUDA kernels when there is a GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def allocator_history(device: torch.device) -> types.ModuleType | None:
    """The module that records the allocator's history (``torch.cuda.memory``); None on a CPU."""
    if device.type not in ("cuda", "xpu"):
        return None
    return torch.get_device_module(device).memory


@dataclass(frozen=True)
class _GpuPeak:
    """Dense peak matmul FLOP/s of one accelerator model."""

    bf16: float  # also the fp16 rate on every listed model
    fp32: float  # plain fp32, i.e. without TF32 tensor cores


# The first match wins: specific H100 variants before the SXM entry; word boundaries keep "A10" from
# matching "A100" or "A10G".
_KNOWN_GPUS: tuple[tuple[str, _GpuPeak], ...] = (
    (r"\bH100\b.*\bNVL\b", _GpuPeak(bf16=835e12, fp32=60e12)),
    (r"\bH100\b.*\bPCIe\b", _GpuPeak(bf16=756e12, fp32=51e12)),
    (r"\bH100\b", _GpuPeak(bf16=989e12, fp32=67e12)),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    (r"\bG?H200\b", _GpuPeak(bf16=989e12, fp32=67e12)),
    (r"\bB200\b", _GpuPeak(bf16=2250e12, fp32=75e12)),
    (r"\bA100\b", _GpuPeak(bf16=312e12, fp32=19.5e12)),
    (r"\bL40S\b", _GpuPeak(bf16=362e12, fp32=91.6e12)),
    (r"\bA10G\b", _GpuPeak(bf16=70e12, fp32=35e12)),
    (r"\bA10\b", _GpuPeak(bf16=125e12, fp32=31.2e12)),
    (r"\bL4\b", _GpuPeak(bf16=121e12, fp32=30.3e12)),
    (r"\bMI300X\b", _GpuPeak(bf16=1307.4e12, fp32=163.4e12)),
    (r"\bMI325X\b", _GpuPeak(bf16=1307.4e12, fp32=163.4e12)),
    (r"\bMI250X?\b", _GpuPeak(bf16=383e12, fp32=95.7e12)),
)


def _known_gpu_peak(device_name: str) -> _GpuPeak | None:
    for pattern, peak in _KNOWN_GPUS:
        if re.search(pattern, device_name):
            return peak
    return None


@dataclass(frozen=True)
class PeakFlops:
    """The denominator of MFU and where it comes from, e.g. ``measured: 2048x2048 bfloat16 matmul, 1 thread``."""

    flops: float
    source: str

    def __str__(self) -> str:
        return f"peak {self.flops / 1e12:.3g} TFLOP/s {self.source}"


def use_deterministic_algorithms(warn_only: bool = False) -> None:
    """torch's deterministic kernels; on CUDA cuBLAS also needs a fixed workspace, and cuDNN must not
    pick kernels by timing them."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.benchmark = False


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


# CPU peak: the largest size whose matmul fits twice in the budget is timed for about the budget, best
# run kept (other processes only ever slow a run down). Below 1024 a CPU runs below its sustained rate.
_CPU_MATMUL_SIZES = (512, 1024, 2048)
_CPU_BUDGET_SECONDS = 0.5


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _time_matmul(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    start = time.perf_counter()
    torch.matmul(a, b)
    synchronize(device)
    return time.perf_counter() - start


def _square(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(size, size, device=device).to(dtype)


def _pick_cpu_size(dtype: torch.dtype, device: torch.device) -> tuple[int, float] | None:
    """The largest size whose matmul takes at most half the budget, with its time; None when even the
    first takes longer than the whole budget."""
    picked = None
    for size in _CPU_MATMUL_SIZES:
        if picked is not None and picked[1] * (size / picked[0]) ** 3 > _CPU_BUDGET_SECONDS / 2:
            break
        seconds = _time_matmul(_square(size, dtype, device), _square(size, dtype, device), device)
        if seconds > _CPU_BUDGET_SECONDS:
            if picked is None:
                logger.warning(
                    "no MFU: a %dx%d %s matmul takes %.2f s on this CPU, longer than the %.1f s a measurement may take",
                    size,
                    size,
                    _dtype_name(dtype),
                    seconds,
                    _CPU_BUDGET_SECONDS,
                )
            break
        picked = (size, seconds)
    return picked


@functools.cache
def _cpu_matmul_peak(dtype: torch.dtype, threads: int) -> PeakFlops | None:
    """Best achieved FLOP/s of a square ``dtype`` matmul on ``threads`` threads, or None (no CPU
    matmul for the dtype, or too slow)."""
    device = torch.device("cpu")
    try:
        _time_matmul(_square(64, dtype, device), _square(64, dtype, device), device)  # kernel set-up
        picked = _pick_cpu_size(dtype, device)
        if picked is None:
            return None
        size, best = picked
        a, b = _square(size, dtype, device), _square(size, dtype, device)
        spent = best
        while spent < _CPU_BUDGET_SECONDS:
            seconds = _time_matmul(a, b, device)
            best, spent = min(best, seconds), spent + seconds
    except RuntimeError as error:
        logger.warning("no MFU: cannot time a %s matmul on this CPU (%s)", _dtype_name(dtype), error)
        return None
    thread_s = "thread" if threads == 1 else "threads"
    return PeakFlops(2 * size**3 / best, f"measured: {size}x{size} {_dtype_name(dtype)} matmul, {threads} {thread_s}")


@functools.cache
def _accelerator_matmul_peak(device: torch.device, dtype: torch.dtype) -> PeakFlops:
    """Achieved FLOP/s of a 4096x4096 matmul (accelerators need large ones), timed for 0.25 s."""
    size = 4096
    a, b = _square(size, dtype, device), _square(size, dtype, device)
    _time_matmul(a, b, device)  # warm-up: kernel selection and first-touch allocation
    iterations, elapsed = 0, 0.0
    while elapsed < 0.25:
        elapsed += _time_matmul(a, b, device)
        iterations += 1
    return PeakFlops(2 * size**3 * iterations / elapsed, f"measured: {size}x{size} {_dtype_name(dtype)} matmul")


def _benchmark_matmul_flops(device: torch.device, dtype: torch.dtype) -> PeakFlops | None:
    if device.type == "cpu":
        return _cpu_matmul_peak(dtype, torch.get_num_threads())
    return _accelerator_matmul_peak(device, dtype)


def device_peak(device: torch.device, dtype: torch.dtype, override: float | None = None) -> PeakFlops | None:
    """Peak dense matmul FLOP/s of ``device`` for ``dtype`` (the denominator of MFU), or None when it
    cannot be known: better no MFU than a wrong one. ``override`` is the user's figure.

    Known GPUs take their datasheet rate (fp32 the TF32 one, half bf16's, when TF32 is on). Elsewhere
    a matmul benchmark runs once per process and (device, dtype), in the threads the process trains
    with: MFU there is the fraction of what this process's matmul reaches."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"device_peak_flops: override must be > 0, got {override}")
        return PeakFlops(float(override), "as configured")
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = torch.cuda.get_device_name(device)
        peak = _known_gpu_peak(name)
        if peak is None:
            logger.warning("Unknown GPU %r: benchmarking matmul FLOP/s for MFU", name)
        elif dtype != torch.float32:
            return PeakFlops(peak.bf16, f"datasheet: {name}, {_dtype_name(dtype)} dense")
        elif torch.version.hip is None and torch.backends.cuda.matmul.allow_tf32:
            return PeakFlops(peak.bf16 / 2, f"datasheet: {name}, tf32 dense")
        else:
            return PeakFlops(peak.fp32, f"datasheet: {name}, float32")
    return _benchmark_matmul_flops(device, dtype)


def device_peak_flops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float | None:
    """``device_peak(...).flops``, or None when the peak cannot be known."""
    peak = device_peak(device, dtype, override)
    return None if peak is None else peak.flops
