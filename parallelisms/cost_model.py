"""Cost models for bucket planning: an alpha-beta model of one ring collective (given, or
calibrated on the process group) and a FLOP rate (given, or measured on a module of the model)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.device import all_gather_into, synchronize

logger = logging.getLogger(__name__)

_MIB = 1024**2


def _ring_fraction(world_size: int) -> float:
    """Fraction of the full buffer each rank sends (and receives) in a ring all-gather/reduce-scatter."""
    return (world_size - 1) / world_size


@dataclass(frozen=True)
class CommModel:
    """Alpha-beta cost of one collective: a fixed latency (launch plus ring start-up) plus the bytes
    over the bus bandwidth (what nccl-tests reports as ``busbw``)."""

    alpha_s: float
    bandwidth_bytes_per_s: float

    @classmethod
    def from_config(cls, alpha_us: float, bandwidth_gbps: float) -> CommModel:
        """From a latency in microseconds and a bus bandwidth in GB/s (1e9 bytes per second)."""
        return cls(alpha_s=alpha_us * 1e-6, bandwidth_bytes_per_s=bandwidth_gbps * 1e9)

    def time(self, num_bytes: float) -> float:
        return self.alpha_s + num_bytes / self.bandwidth_bytes_per_s

    def all_gather_time(self, full_bytes: float, world_size: int) -> float:
        """Ring all-gather of ``full_bytes``: each rank forwards the N - 1 shards it does not own. An
        empty bucket issues no collective."""
        if full_bytes == 0:
            return 0.0
        return self.time(_ring_fraction(world_size) * full_bytes)

    def reduce_scatter_time(self, full_bytes: float, world_size: int) -> float:
        """The mirror of the all-gather, the same bytes on the wire (the reduction's arithmetic ignored)."""
        return self.all_gather_time(full_bytes, world_size)


@dataclass(frozen=True)
class ComputeModel:
    """Compute time from a FLOP count at a fixed achieved rate."""

    flops_per_second: float

    @classmethod
    def from_config(cls, compute_flops: float | None, measure: Callable[[], float]) -> ComputeModel:
        """The configured rate, or when unset what ``measure`` returns."""
        return cls(float(compute_flops) if compute_flops is not None else measure())

    def time(self, flops: float) -> float:
        return flops / self.flops_per_second


FALLBACK_COMM_MODEL = CommModel(alpha_s=100e-6, bandwidth_bytes_per_s=1e9)
"""What calibration falls back to when timing is too noisy to fit (gloo on one host)."""


class _AllGatherTimer:
    """Times one all-gather on the group as SimpleFSDP's compiled graphs do it, buffers kept per size."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self._group = group
        self._device = device
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, full_bytes: int) -> float:
        if full_bytes not in self._buffers:
            world_size = dist.get_world_size(self._group)
            shard = torch.ones(full_bytes // world_size, dtype=torch.uint8, device=self._device)
            output = torch.empty(full_bytes, dtype=torch.uint8, device=self._device)
            self._buffers[full_bytes] = (shard, output)
        shard, output = self._buffers[full_bytes]
        synchronize(self._device)
        start = time.perf_counter()
        all_gather_into(output, shard, self._group or dist.group.WORLD)
        synchronize(self._device)
        return time.perf_counter() - start


def measure_rate(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], flops: float, min_seconds: float = 0.2
) -> float:
    """FLOP/s of eager forward and backward passes of ``module`` (``flops`` per pass), timed after an
    untimed one over at least ``min_seconds`` and 2 passes. The whole computation's rate, not its
    matmuls': where attention and norms weigh (bf16 on AMX), a matmul benchmark overstates it
    several times, and the planner would see little compute to hide communication behind."""
    device = next(module.parameters()).device

    def one_pass() -> None:
        outputs = module(*inputs)
        outputs.float().sum().backward()

    one_pass()
    synchronize(device)
    passes, start = 0, time.perf_counter()
    while passes < 2 or time.perf_counter() - start < min_seconds:
        one_pass()
        passes += 1
        synchronize(device)
    return flops * passes / (time.perf_counter() - start)


def calibrate_comm_model(
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    sizes: tuple[int, int] = (64 * 1024, 16 * _MIB),
    iters: int = 10,
    warmup: int = 2,
    time_all_gather: Callable[[int], float] | None = None,
) -> CommModel:
    """Fits a ``CommModel`` to all-gathers of two message sizes on ``group``; call it on every rank.

    Each size gets ``warmup`` untimed runs, a barrier, and ``iters`` timed runs whose median is this
    rank's time; the slowest rank's (all-reduce MAX) is what a collective costs, and gives every
    rank the same model. ``time_all_gather`` (seconds of one all-gather of the given full bytes)
    defaults to timing ``all_gather_into`` on ``group``. Timing too noisy to fit (the large message
    no slower) falls back to ``FALLBACK_COMM_MODEL`` with a warning."""
    world_size = dist.get_world_size(group)
    if world_size < 2:
        raise ValueError(f"calibrate_comm_model needs >= 2 ranks to time traffic, got {world_size}")
    small_bytes, large_bytes = (size // world_size * world_size for size in sizes)
    device = torch.device(device)
    timer = time_all_gather or _AllGatherTimer(group, device)

    local_medians = []
    for full_bytes in (small_bytes, large_bytes):
        for _ in range(warmup):
            timer(full_bytes)
        dist.barrier(group)
        local_medians.append(statistics.median(timer(full_bytes) for _ in range(iters)))
    slowest = torch.tensor(local_medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    small_s, large_s = slowest.tolist()
    model = _fit_alpha_beta(small_bytes, small_s, large_bytes, large_s, world_size)
    logger.info(
        "Calibrated all-gather over %d ranks: %.1f us for %d B, %.1f us for %d B -> alpha %.1f us, bandwidth %.3f GB/s",
        world_size,
        small_s * 1e6,
        small_bytes,
        large_s * 1e6,
        large_bytes,
        model.alpha_s * 1e6,
        model.bandwidth_bytes_per_s / 1e9,
    )
    return model


def _fit_alpha_beta(small_bytes: int, small_s: float, large_bytes: int, large_s: float, world_size: int) -> CommModel:
    """The alpha-beta model through two timed all-gathers."""
    if not large_s > small_s:
        logger.warning(
            "Communication calibration: an all-gather of %d B took %.3e s, not longer than %d B (%.3e s); "
            "timing is too noisy, using alpha %.0f us and bandwidth %.1f GB/s (configure both to choose)",
            *(large_bytes, large_s, small_bytes, small_s, FALLBACK_COMM_MODEL.alpha_s * 1e6),
            FALLBACK_COMM_MODEL.bandwidth_bytes_per_s / 1e9,
        )
        return FALLBACK_COMM_MODEL
    fraction = _ring_fraction(world_size)
    bandwidth = fraction * (large_bytes - small_bytes) / (large_s - small_s)
    alpha = small_s - fraction * small_bytes / bandwidth
    if alpha < 0:
        # Timing noise can put the fitted line below the origin; a latency cannot be negative.
        logger.warning("Calibrated all-gather latency %.3e s is negative: using 0", alpha)
        alpha = 0.0
    return CommModel(alpha_s=alpha, bandwidth_bytes_per_s=bandwidth)
