"""Data parallelism with torch's FSDP2 (``fully_shard``): FSDP, HSDP and DDP."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from parallelisms.device import (
    all_gather_as_broadcasts,
    all_gather_into,
    pinned_memory_available,
    reduce_scatter_as_all_to_all,
)


def _sum_gradients(module: FSDPModule) -> None:
    # The trainer divides the loss by the global token count, so gradients must be summed, not
    # averaged; gloo has no PREMUL_SUM, hence plain SUM collectives.
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


class _PlainBuffers:
    """Buffers of a custom FSDP2 collective: plain ``torch.empty`` tensors."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class AllToAllReduceScatter(_PlainBuffers, ReduceScatter):
    """A sum reduce-scatter as an all-to-all of chunks and a sum (``reduce_scatter_as_all_to_all``)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op != dist.ReduceOp.SUM or async_op:
            raise ValueError(f"the all-to-all reduce-scatter sums synchronously, not {op} (async_op={async_op})")
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(group.size(), -1), dim=0, out=output_tensor)
        return None


class BroadcastAllGather(_PlainBuffers, AllGather):
    """An all-gather as one broadcast per rank (``all_gather_as_broadcasts``); float8 travels as bytes
    (gloo has no float8). An asynchronous one, which must return one Work, is gloo's own."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if output_tensor.dtype.itemsize == 1:  # float8 weights, gathered in float8
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        if async_op:  # a prefetch (pipeline schedules unshard ahead): one Work to wait for
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=True)
        all_gather_into(output_tensor, input_tensor, group)
        return None


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    blocks: list[nn.Module],
    reshard_last_block: bool = False,
    cpu_offload: bool = False,
    forward_prefetch: int | None = None,
    backward_prefetch: int | None = None,
) -> None:
    """Shards ``model`` over ``dp_mesh`` (2-D: HSDP), one FSDP unit per block plus the root. Resharding
    keeps the last block gathered (backward needs it at once) unless ``reshard_last_block``. With
    ``cpu_offload`` the shards, their gradients and the optimizer state live in host memory (the
    model is materialized there). ``forward_prefetch``/``backward_prefetch``: gathers issued ahead of
    the unit in use (``prefetch_plan``); None leaves FSDP2's own."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=pinned_memory_available()) if cpu_offload else OffloadPolicy()
    shard = functools.partial(fully_shard, mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload)
    for i, block in enumerate(blocks):
        shard(block, reshard_after_forward=reshard_after_forward and (reshard_last_block or i < len(blocks) - 1))
    shard(model, reshard_after_forward=reshard_after_forward)
    units = [model, *blocks]
    if forward_prefetch is not None:
        for unit, ahead in zip(units, prefetch_plan(len(units), forward_prefetch, "forward_prefetch")):
            unit.set_modules_to_forward_prefetch([units[j] for j in ahead])
    if backward_prefetch is not None:
        # Backward starts at the root's output layer, then runs the blocks last to first.
        order = [model, *reversed(blocks)]
        for unit, ahead in zip(order, prefetch_plan(len(order), backward_prefetch, "backward_prefetch")):
            unit.set_modules_to_backward_prefetch([order[j] for j in ahead])
    shard_group = dp_mesh.get_group(dp_mesh.ndim - 1)  # FSDP2 reduce-scatters over the shard dimension
    device = torch.device(dp_mesh.device_type)
    all_to_all = reduce_scatter_as_all_to_all(shard_group, device)
    broadcasts = all_gather_as_broadcasts(shard_group, device)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_gradients(module)
            if all_to_all:
                module.set_custom_reduce_scatter(AllToAllReduceScatter())
            if broadcasts:
                module.set_custom_all_gather(BroadcastAllGather())


def prefetch_plan(units: int, ahead: int, name: str) -> list[list[int]]:
    """For each of ``units`` in execution order, the indices of the units whose gathers it issues:
    the next ``ahead`` (-1: all the rest). ``name``: the parameter, for the error."""
    check_prefetch(ahead, name)
    return [list(range(i + 1, units if ahead == -1 else min(units, i + 1 + ahead))) for i in range(units)]


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """Replicates ``model`` over ``dp_mesh``: every rank holds all parameters, gradients are all-reduced."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
    _sum_gradients(model)


def check_prefetch(ahead: int, name: str) -> None:
    """A prefetch limit is -1 (all) or a positive number of units; ``name``: the parameter."""
    if ahead != -1 and ahead < 1:
        raise ValueError(f"{name} must be -1 (all) or positive, got {ahead}")
