"""Data parallelism with torch's FSDP2 (``fully_shard``): FSDP, HSDP and DDP."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def _sum_gradients(module: FSDPModule) -> None:
    # The trainer divides the loss by the global token count, so gradients must be summed, not
    # averaged; gloo has no PREMUL_SUM, hence plain SUM collectives.
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    blocks: list[nn.Module],
) -> None:
    """Shards ``model`` over ``dp_mesh``: one FSDP unit per block in ``blocks`` plus the root.

    A 1-D mesh gives FSDP; a 2-D ``(dp_replicate, dp_shard)`` mesh gives HSDP.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            _sum_gradients(module)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """Replicates ``model`` over ``dp_mesh``: every rank holds all parameters, gradients are all-reduced."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    replicate(model, mesh=dp_mesh, mp_policy=mp_policy)
    _sum_gradients(model)
