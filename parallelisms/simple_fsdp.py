"""SimpleFSDP: data parallelism as sharded DTensor storage plus a gather on attribute access.

Every parameter is stored as a DTensor on the data-parallel mesh (FSDP ``Shard(0)``, DDP
``Replicate()``, HSDP ``(Replicate(), Shard(0))``) under its own name, so the optimizer,
``state_dict()`` and DCP only see shards. Reading ``module.weight`` runs one traceable gather
(redistribute to ``Replicate``, ``to_local`` with a ``Partial`` gradient) through a property of a
cached subclass; autograd turns the gradient into a reduce-scatter, an all-reduce or both, summed.

Reshard after forward. Each gather runs under an ``fx.traceback`` annotation; under compile the
partitioner recomputes the annotated gathers in backward (``mark_gathers_for_partitioner``). In
eager the matmul would save the gathered weight, so each resharded block runs its forward in a
block-level region that replays only the gathers (and views aliasing them) in backward and saves
everything else. A block already under ``checkpoint_wrapper`` needs no region: its checkpoint
redoes the gathers. Given the model's ``blocks``, only they reshard: backward starts with the
parameters outside them, so gathering those again would only expose an all-gather. Unlike FSDP2
in ``apply_fsdp2`` the last block reshards too: its weights would sit beside the loss's backward,
at the step's peak. Under compile (``compiled=True``) the regions are left out: their
save-everything policy would override the partitioner's choice of activations.

Tensor parallelism. A TP DTensor parameter is stored on the (dp..., tp) mesh, with a strided dp
shard when TP also splits dim 0 (FSDP2's layout); the gather re-wraps the local shard on the dp
mesh, gathers it, and re-wraps the result on the TP mesh for the TP styles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallelisms.device import pinned_memory_available

Mode = Literal["replicate", "fully_shard", "hybrid_shard"]

_STORAGE_PLACEMENTS: dict[str, tuple[Placement, ...]] = {
    "replicate": (Replicate(),),
    "fully_shard": (Shard(0),),
    "hybrid_shard": (Replicate(), Shard(0)),
}

GATHER_ANNOTATION = "simple_fsdp_reshard_after_forward"
"""Key of the ``fx.traceback`` annotation on a gather's nodes; its value: reshard after forward."""
_COLLECTIVES_NAMESPACE = "_c10d_functional"
# The casts between a parameter's shard and its all-gather (mixed precision): with the collectives,
# the nodes whose saving or recomputing decides what backward holds.
_CAST_OPS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}
# Collective bookkeeping that returns its input: like a view, it aliases the collective's buffer.
_ALIASING_COLLECTIVE_OPS = {
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops._c10d_functional._wrap_tensor_autograd.default,
}


@dataclass
class _GatherConfig:
    """How one model's parameters are gathered; shared by all the modules of that model."""

    dp_mesh: DeviceMesh
    dp_placements: tuple[Placement, ...]
    hsdp_meshes: tuple[DeviceMesh, DeviceMesh] | None  # HSDP: (replicate, shard), one at a time
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: bool
    offload: _Offload | None = None


@dataclass(frozen=True)
class _Offload:
    """Shards stored in host memory, copied to ``device`` for their gather."""

    device: torch.device
    pinned: bool  # pinned host storage, copied without blocking


@dataclass(frozen=True)
class _TensorParallelLayout:
    """A tensor-parallel parameter as the TP styles expect it: a DTensor on the TP mesh."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    local_shape: torch.Size  # this rank's TP part, which the data-parallel mesh shards
    local_stride: tuple[int, ...]


def _replicate_to_local(tensor: DTensor, forward_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> torch.Tensor:
    """All-gathers ``tensor`` (cast first: bf16 on the wire) into a plain local tensor; backward sums
    the gradient over the mesh in ``reduce_dtype``."""
    replicated = tensor.redistribute(
        placements=[Replicate()] * tensor.device_mesh.ndim, forward_dtype=forward_dtype, backward_dtype=reduce_dtype
    )
    return replicated.to_local(grad_placements=[Partial("sum")] * tensor.device_mesh.ndim)


def _gather_over_dp(
    local_shard: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], config: _GatherConfig
) -> torch.Tensor:
    """The full tensor (of ``shape``) whose data-parallel shard is ``local_shard``, in ``param_dtype``."""
    if config.hsdp_meshes is None:
        # FSDP: all-gather / reduce-scatter. DDP: nothing / all-reduce.
        sharded = DTensor.from_local(
            local_shard, config.dp_mesh, config.dp_placements, run_check=False, shape=shape, stride=stride
        )
        return _replicate_to_local(sharded, config.param_dtype, config.reduce_dtype)
    # HSDP, one mesh dim at a time. Backward runs the steps in reverse: reduce-scatter within the
    # replica first, then all-reduce only the 1/N shard across replicas, as FSDP2 does. (DTensor's
    # own plan all-reduces the full gradient first: N times the traffic, another summation order.)
    replicate_mesh, shard_mesh = config.hsdp_meshes
    replica = DTensor.from_local(local_shard, replicate_mesh, [Replicate()], run_check=False)
    shard = _replicate_to_local(replica, None, config.reduce_dtype)
    sharded = DTensor.from_local(shard, shard_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return _replicate_to_local(sharded, config.param_dtype, config.reduce_dtype)


def _gather(param: DTensor, config: _GatherConfig, tp: _TensorParallelLayout | None) -> torch.Tensor:
    """``param`` gathered over the data-parallel mesh alone (a TP part then re-wrapped on its own)."""
    local = param.to_local()
    if config.offload is not None:
        # Autograd copies the gradient back to the host shard; under compile the copy is traced.
        local = local.to(config.offload.device, non_blocking=config.offload.pinned)
    if tp is None:
        return _gather_over_dp(local, param.shape, param.stride(), config)
    tp_part = _gather_over_dp(local, tp.local_shape, tp.local_stride, config)
    return DTensor.from_local(tp_part, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride)


def _block_region_policy(dp_group_names: frozenset[str]) -> Callable[..., CheckpointPolicy]:
    """Replay the weights' all-gathers in backward; save everything else."""

    def policy(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # Views (the gathered weight's transpose, the collective's slice) and waits alias the
        # gathered buffer: saving one would keep the full weight alive.
        aliases = op.is_view or op in _ALIASING_COLLECTIVE_OPS
        # Collectives on the data-parallel groups are the gathers. Tensor-parallel ones act on
        # activations: saved, not issued again. The weight's cast is saved too: it runs on the
        # shard, before the all-gather, so it is small.
        gathers = op.namespace == _COLLECTIVES_NAMESPACE and any(
            isinstance(arg, str) and arg in dp_group_names for arg in args
        )
        return CheckpointPolicy.MUST_RECOMPUTE if aliases or gathers else CheckpointPolicy.MUST_SAVE

    return policy


def _gathered_parameter(module: nn.Module, name: str) -> torch.Tensor:
    config: _GatherConfig = module._simple_fsdp_config
    # Under compile, the partitioner reads the annotation (mark_gathers_for_partitioner).
    with fx_traceback.annotate({GATHER_ANNOTATION: config.reshard_after_forward}):
        return _gather(module._parameters[name], config, module._simple_fsdp_tp_layouts.get(name))


def mark_gathers_for_partitioner(joint: fx.GraphModule) -> None:
    """Tags every gather's collectives, waits and cast in a compiled joint graph ``MUST_RECOMPUTE``
    when resharding, ``MUST_SAVE`` when not; the views around them are the partitioner's choice."""
    for node in joint.graph.nodes:
        custom = node.meta.get("custom") or {}
        if GATHER_ANNOTATION not in custom or node.meta.get("partitioner_tag") == "is_backward":
            continue
        carries_decision = node.target in _CAST_OPS or getattr(node.target, "namespace", None) == _COLLECTIVES_NAMESPACE
        if carries_decision:
            reshard = custom[GATHER_ANNOTATION]
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
        else:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE


_GATHERING_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}
_RESHARDING_CLASSES: dict[type, type] = {}


def _gathering_class(cls: type[nn.Module], param_names: tuple[str, ...]) -> type[nn.Module]:
    """``cls`` with a property per parameter name that returns the gathered parameter."""
    key = (cls, param_names)
    if key not in _GATHERING_CLASSES:
        properties: dict[str, Any] = {
            name: property(functools.partial(_gathered_parameter, name=name), doc=f"Gathered `{name}`.")
            for name in param_names
        }

        def _apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
            # to_empty and .to make new host shards: pin those that are offloaded.
            cls._apply(self, fn, recurse)
            _pin_host_shards(self)
            return self

        properties["_apply"] = _apply
        _GATHERING_CLASSES[key] = type(f"SimpleFSDP{cls.__name__}", (cls,), properties)
    return _GATHERING_CLASSES[key]


def _pin_host_shards(module: nn.Module) -> None:
    offload = module._simple_fsdp_config.offload
    if offload is None or not offload.pinned:
        return
    for param in module._parameters.values():
        local = param._local_tensor
        if local.device.type == "cpu" and not local.is_meta and not local.is_pinned():
            param._local_tensor = local.pin_memory()  # in place: a tied parameter stays one


def _resharding_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` whose forward runs in a block-level region that re-gathers weights in backward."""
    if cls not in _RESHARDING_CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(
                cls.forward,
                self,
                *args,
                use_reentrant=False,
                context_fn=self._simple_fsdp_block_contexts,
                # Only gathers and views are replayed; every random op's output comes from the cache.
                preserve_rng_state=False,
                **kwargs,
            )

        _RESHARDING_CLASSES[cls] = type(f"Resharding{cls.__name__}", (cls,), {"forward": forward})
    return _RESHARDING_CLASSES[cls]


def _shard_plain(param: torch.Tensor, config: _GatherConfig) -> DTensor:
    # A meta model has no values to send: every rank takes its own chunk. A materialized one is
    # split from rank 0's copy, so all ranks agree even if their initializations differed.
    src_data_rank = None if param.is_meta else 0
    return distribute_tensor(param.detach(), config.dp_mesh, config.dp_placements, src_data_rank=src_data_rank)


def _shard_tensor_parallel(param: DTensor, config: _GatherConfig) -> tuple[DTensor, _TensorParallelLayout]:
    """Storage for a TP parameter: its TP part sharded over dp, on the (dp..., tp) mesh."""
    tp_mesh, dp_names = param.device_mesh, config.dp_mesh.mesh_dim_names
    if tp_mesh.ndim != 1 or tp_mesh.mesh_dim_names is None or dp_names is None:
        raise NotImplementedError(f"SimpleFSDP over DTensors needs named 1-D TP and dp meshes, got {tp_mesh}")
    tp_part = param.detach().to_local()
    dp_shard = distribute_tensor(tp_part, config.dp_mesh, config.dp_placements, src_data_rank=None).to_local()
    # When TP also splits dim 0, the dp split applies within each TP part: a strided shard.
    tp_splits_dim0 = any(p.is_shard(0) for p in param.placements)
    dp_placements = [
        _StridedShard(0, split_factor=tp_mesh.size()) if tp_splits_dim0 and p.is_shard(0) else p
        for p in config.dp_placements
    ]
    storage_mesh = config.dp_mesh._get_root_mesh()[(*dp_names, *tp_mesh.mesh_dim_names)]
    storage = DTensor.from_local(
        dp_shard,
        storage_mesh,
        [*dp_placements, *param.placements],
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    layout = _TensorParallelLayout(
        tp_mesh, tuple(param.placements), param.shape, param.stride(), tp_part.shape, tp_part.stride()
    )
    return storage, layout


def _shard_parameters(model: nn.Module, config: _GatherConfig) -> None:
    """Replaces every parameter by its sharded storage and swaps its module's class."""
    sharded: dict[int, tuple[nn.Parameter, _TensorParallelLayout | None]] = {}  # tied parameters stay tied
    for module in model.modules():
        names = tuple(name for name, param in module._parameters.items() if param is not None)
        if not names:
            continue
        tp_layouts = {}
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:
                if isinstance(param, DTensor):
                    storage, layout = _shard_tensor_parallel(param, config)
                else:
                    storage, layout = _shard_plain(param, config), None
                sharded[id(param)] = nn.Parameter(storage, requires_grad=param.requires_grad), layout
            module._parameters[name], layout = sharded[id(param)]
            if layout is not None:
                tp_layouts[name] = layout
        module._simple_fsdp_config = config
        module._simple_fsdp_tp_layouts = tp_layouts
        module.__class__ = _gathering_class(type(module), names)


def _keep_gathered_outside(model: nn.Module, blocks: list[nn.Module], config: _GatherConfig) -> None:
    """The parameters outside ``blocks`` keep their gathered copy from forward to backward."""
    in_blocks = {id(module) for block in blocks for module in block.modules()}
    keep_config = replace(config, reshard_after_forward=False)
    for module in model.modules():
        if id(module) not in in_blocks and hasattr(module, "_simple_fsdp_config"):
            module._simple_fsdp_config = keep_config


def apply_simple_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mode: Mode,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool,
    blocks: list[nn.Module] | None = None,
    compiled: bool = False,
    cpu_offload: bool = False,
) -> None:
    """Shards ``model``'s parameters (on the meta device or materialized; maybe TP DTensors on a named
    1-D mesh of the same root) over ``dp_mesh`` in place and gathers them on access. ``dp_mesh`` is
    1-D, or for ``hybrid_shard`` 2-D with named dims. Without ``blocks`` every gather is tagged to
    reshard, which only a compiled model follows. Gradients are summed over the ranks, not averaged.
    With ``cpu_offload`` the shards (so their gradients and optimizer state) live in host memory,
    pinned where that helps (the caller materializes them there: ``to_empty(device="cpu")``), and
    each gather copies its shard to ``dp_mesh``'s device first."""
    placements = _STORAGE_PLACEMENTS[mode]
    if dp_mesh.ndim != len(placements):
        raise ValueError(f"mode {mode!r} needs a {len(placements)}-D mesh, got {dp_mesh.ndim}-D")
    hsdp_meshes = None
    if mode == "hybrid_shard":
        if dp_mesh.mesh_dim_names is None:
            raise ValueError("hybrid_shard needs a mesh with named dims (dp_replicate, dp_shard)")
        hsdp_meshes = tuple(dp_mesh[name] for name in dp_mesh.mesh_dim_names)
    reshard_after_forward = reshard_after_forward and mode != "replicate"
    offload = _Offload(torch.device(dp_mesh.device_type), pinned_memory_available()) if cpu_offload else None
    config = _GatherConfig(dp_mesh, placements, hsdp_meshes, param_dtype, reduce_dtype, reshard_after_forward, offload)
    _shard_parameters(model, config)
    if not reshard_after_forward or blocks is None:
        return
    _keep_gathered_outside(model, blocks, config)
    if compiled:
        return
    dp_group_names = frozenset(group.group_name for group in dp_mesh.get_all_groups())
    # Saving every op's output includes tensors later updated in place (RMSNorm's `mean`, then
    # `add_(eps)`). Only views and the weights' gathers are replayed, and neither reads such a
    # tensor's values, so handing back the updated tensor is safe: allow it instead of raising.
    block_contexts = functools.partial(
        create_selective_checkpoint_contexts, _block_region_policy(dp_group_names), allow_cache_entry_mutation=True
    )
    for block in blocks:
        if not isinstance(block, CheckpointWrapper):
            block._simple_fsdp_block_contexts = block_contexts
            block.__class__ = _resharding_class(type(block))
