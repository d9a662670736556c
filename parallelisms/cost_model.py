"""Cost models for bucket planning and the layout planner: an alpha-beta model of one collective
(given, or calibrated on the process group) and a FLOP rate (given, or measured on a module of the model)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallelisms.device import all_gather_into, reduce_scatter_as_all_to_all, synchronize
from parallelisms.fsdp2 import AllToAllReduceScatter

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


# Bytes crossing one rank's busiest link per byte of the message, over the ring fraction (N - 1) / N
# for the collectives: a ring all-gather or reduce-scatter of the full buffer sends N - 1 of its N
# shards, an all-reduce is one of each; a send moves the message once.
_WIRE_RINGS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
COLLECTIVES = (*_WIRE_RINGS, "send")
"""The collectives calibration fits, by the names the calibration file gives them."""


def wire_bytes(kind: str, num_bytes: float, world_size: int) -> float:
    """The bytes over the bus bandwidth in ``kind``'s alpha-beta time: of the full buffer for a
    collective (see ``_WIRE_RINGS``), of the message for a send."""
    if kind == "send":
        return float(num_bytes)
    return _WIRE_RINGS[kind] * _ring_fraction(world_size) * num_bytes


class _CollectiveTimer:
    """Times one ``kind`` on the group as training runs it, buffers kept per size: an all-gather as
    ``all_gather_into``, a reduce-scatter as FSDP2's (an all-to-all and a sum where gloo's own copies
    its input), a send as half a round trip from rank 0 to 1 (the other ranks idle and report 0)."""

    def __init__(self, kind: str, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self._kind = kind
        self._group = group or dist.group.WORLD
        self._device = device
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffers_for(self, full_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if full_bytes not in self._buffers:
            # Reductions sum float32 (gradients); gathers and sends move bytes.
            dtype = torch.float32 if self._kind in ("reduce_scatter", "all_reduce") else torch.uint8
            full = torch.ones(full_bytes // dtype.itemsize, dtype=dtype, device=self._device)
            self._buffers[full_bytes] = (full, torch.ones_like(full.chunk(self._group.size())[0]))
        return self._buffers[full_bytes]

    def _run(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        group = self._group
        if self._kind == "all_gather":
            all_gather_into(full, shard, group)
        elif self._kind == "reduce_scatter" and reduce_scatter_as_all_to_all(group, self._device):
            AllToAllReduceScatter()(shard, full, group, dist.ReduceOp.SUM)
        elif self._kind == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, full, group=group)
        elif self._kind == "all_reduce":
            dist.all_reduce(full, group=group)
        elif group.rank() == 0:
            dist.send(full, group_dst=1, group=group)
            dist.recv(full, group_src=1, group=group)
        elif group.rank() == 1:
            dist.recv(full, group_src=0, group=group)
            dist.send(full, group_dst=0, group=group)

    def __call__(self, full_bytes: int) -> float:
        full, shard = self._buffers_for(full_bytes)
        synchronize(self._device)
        start = time.perf_counter()
        self._run(full, shard)
        synchronize(self._device)
        seconds = time.perf_counter() - start
        if self._kind != "send":
            return seconds
        return seconds / 2 if self._group.rank() == 0 else 0.0


def forward_backward(module: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> None:
    """One eager forward and backward pass of ``module``, its outputs summed as the loss."""
    module(*inputs).float().sum().backward()


def measure_rate(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], flops: float, min_seconds: float = 0.2
) -> float:
    """FLOP/s of eager forward and backward passes of ``module`` (``flops`` per pass), timed after an
    untimed one over at least ``min_seconds`` and 2 passes. The whole computation's rate, not its
    matmuls': where attention and norms weigh (bf16 on AMX), a matmul benchmark overstates it
    several times, and the planner would see little compute to hide communication behind."""
    device = next(module.parameters()).device

    forward_backward(module, inputs)
    synchronize(device)
    passes, start = 0, time.perf_counter()
    while passes < 2 or time.perf_counter() - start < min_seconds:
        forward_backward(module, inputs)
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
    ``time_all_gather`` (seconds of one all-gather of the given full bytes) defaults to timing
    ``all_gather_into`` on ``group``; the rest as ``calibrate_collective``."""
    return calibrate_collective("all_gather", group, device, sizes, iters, warmup, time_all_gather)


def calibrate_collective(
    kind: str,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    sizes: tuple[int, int] = (64 * 1024, 16 * _MIB),
    iters: int = 10,
    warmup: int = 2,
    time_one: Callable[[int], float] | None = None,
) -> CommModel:
    """Fits a ``CommModel`` to one of ``COLLECTIVES`` at two message sizes (bytes of the full buffer,
    of the message for a send) on ``group``; call it on every rank.

    Each size gets ``warmup`` untimed runs, a barrier, and ``iters`` timed runs whose median is this
    rank's time; the slowest rank's (all-reduce MAX) is what it costs, and gives every rank the same
    model. ``time_one`` (seconds of one run of the given bytes) defaults to timing it as training
    runs it. Timing too noisy to fit (the large message no slower) falls back to
    ``FALLBACK_COMM_MODEL`` with a warning."""
    world_size = dist.get_world_size(group)
    if world_size < 2:
        raise ValueError(f"calibrating a {kind} needs >= 2 ranks to time traffic, got {world_size}")
    # Whole float32 elements on every rank.
    small_bytes, large_bytes = (size // (4 * world_size) * 4 * world_size for size in sizes)
    device = torch.device(device)
    timer = time_one or _CollectiveTimer(kind, group, device)

    local_medians = []
    for num_bytes in (small_bytes, large_bytes):
        for _ in range(warmup):
            timer(num_bytes)
        dist.barrier(group)
        local_medians.append(statistics.median(timer(num_bytes) for _ in range(iters)))
    slowest = torch.tensor(local_medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    small_s, large_s = slowest.tolist()
    model = fit_alpha_beta(kind, world_size, (small_bytes, small_s), (large_bytes, large_s))
    logger.info(
        "Calibrated %s over %d ranks: %.1f us for %d B, %.1f us for %d B -> alpha %.1f us, bandwidth %.3f GB/s",
        *(kind, world_size, small_s * 1e6, small_bytes, large_s * 1e6, large_bytes),
        model.alpha_s * 1e6,
        model.bandwidth_bytes_per_s / 1e9,
    )
    return model


def fit_alpha_beta(kind: str, world_size: int, small: tuple[int, float], large: tuple[int, float]) -> CommModel:
    """The alpha-beta model of ``kind`` through two timings, each (bytes, seconds): time = alpha +
    ``wire_bytes`` / bandwidth."""
    (small_bytes, small_s), (large_bytes, large_s) = small, large
    if not large_s > small_s:
        logger.warning(
            "Communication calibration: a %s of %d B took %.3e s, not longer than %d B (%.3e s); "
            "timing is too noisy, using alpha %.0f us and bandwidth %.1f GB/s (configure both to choose)",
            *(kind, large_bytes, large_s, small_bytes, small_s, FALLBACK_COMM_MODEL.alpha_s * 1e6),
            FALLBACK_COMM_MODEL.bandwidth_bytes_per_s / 1e9,
        )
        return FALLBACK_COMM_MODEL
    small_wire, large_wire = (wire_bytes(kind, size, world_size) for size in (small_bytes, large_bytes))
    bandwidth = (large_wire - small_wire) / (large_s - small_s)
    alpha = small_s - small_wire / bandwidth
    if alpha < 0:
        # Timing noise can put the fitted line below the origin; a latency cannot be negative.
        logger.warning("Calibrated %s latency %.3e s is negative: using 0", kind, alpha)
        alpha = 0.0
    return CommModel(alpha_s=alpha, bandwidth_bytes_per_s=bandwidth)
