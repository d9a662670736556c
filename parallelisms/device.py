"""The device a rank computes on, and what it can do: the one place for device-specific choices
(the accelerator's type, its peak matmul rate)."""

from __future__ import annotations

import functools
import logging
import re
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def device_type() -> str:
    """The accelerator's type when there is one (cuda, xpu, ...), otherwise cpu."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cpu"


@dataclass(frozen=True)
class _GpuPeak:
    """Dense (no sparsity) peak matmul FLOP/s of one accelerator model."""

    bf16: float  # also the fp16 rate on every listed model
    fp32: float  # plain fp32, i.e. without TF32 tensor cores


# Ordered: the first pattern that matches the device name wins, so the more
# specific H100 variants come before the generic SXM entry. Word boundaries keep
# "A10" from matching "A100" or "A10G".
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


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@functools.cache
def _benchmark_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Achieved FLOP/s of a square matmul, timed for about a quarter of a second."""
    # Accelerators need large matrices to approach their peak; CPUs saturate early
    # and a large CPU matmul in a slow dtype (fp16) would blow the time budget.
    size = 512 if device.type == "cpu" else 4096
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: kernel selection and first-touch allocation
    synchronize(device)
    iterations = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 0.25:
        torch.matmul(a, b)
        synchronize(device)
        iterations += 1
    flops = 2 * size**3 * iterations / elapsed
    logger.info(
        "Measured %.1f TFLOP/s for a %dx%d %s matmul on %s (%d threads)",
        flops / 1e12,
        size,
        size,
        dtype,
        device,
        torch.get_num_threads(),
    )
    return flops


def device_peak_flops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float:
    """Peak dense matmul FLOP/s of ``device`` for ``dtype``, the denominator of MFU.

    Args:
        device: device the model runs on.
        dtype: dtype the matmuls run in (bf16 under mixed precision).
        override: returned as is when given (e.g. from the config).

    Known GPUs are looked up by ``torch.cuda.get_device_name`` (bf16/fp16 dense
    rates; fp32 uses the TF32 rate, half the bf16 one, when TF32 matmuls are
    enabled on CUDA, else the much lower plain fp32 rate). On a CPU, an unknown
    GPU, or other dtypes, a short square-matmul benchmark is run once per
    process and (device, dtype); that is achieved rather than theoretical peak,
    so MFU there means "fraction of what this machine's matmul reaches".
    """
    if override is not None:
        if not override > 0:
            raise ValueError(f"device_peak_flops: override must be > 0, got {override}")
        return float(override)
    device = torch.device(device)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = torch.cuda.get_device_name(device)
        peak = _known_gpu_peak(name)
        if peak is None:
            logger.warning("Unknown GPU %r: benchmarking matmul FLOP/s for MFU", name)
        elif dtype != torch.float32:
            return peak.bf16
        elif torch.version.hip is None and torch.backends.cuda.matmul.allow_tf32:
            return peak.bf16 / 2
        else:
            return peak.fp32
    return _benchmark_matmul_flops(device, dtype)
