"""SimpleFSDP: data parallelism as sharded DTensor storage plus a gather on attribute access.

Every parameter is stored as a DTensor on the data-parallel mesh (FSDP ``Shard(0)``, DDP
``Replicate()``, HSDP ``(Replicate(), Shard(0))``) under its original name, so the optimizer,
``state_dict()`` and DCP only ever see the sharded values. Reading ``module.weight`` returns the
gathered full tensor: the module's class is swapped for a cached subclass with one property per
parameter, and the property runs one traceable expression (redistribute to ``Replicate`` then
``to_local`` with a ``Partial`` gradient). Autograd turns that gradient into a reduce-scatter
(FSDP), an all-reduce (DDP) or both (HSDP), summed, in ``reduce_dtype``.

Reshard after forward. Each gather runs in a per-parameter selective-checkpoint region that tags
the all-gather, its wait and the dtype cast ``MUST_RECOMPUTE`` (``MUST_SAVE`` when not
resharding). Under ``torch.compile`` the min-cut partitioner reads these tags and re-gathers in
backward. In eager they are not enough: the matmul that consumes a gathered weight saves it for
backward. So each block in ``reshard_blocks`` also runs its forward in a block-level region that
recomputes only the gathers (and the views aliasing them) and saves everything else; backward
replays the block's forward from those saved outputs and issues the all-gathers again.

Activation checkpointing. A block already wrapped by ``checkpoint_wrapper`` (full AC, op-level
SAC, or the checkpointed blocks of every-N-th AC) gets no block-level region: its checkpoint
re-runs the block in backward and recomputes everything its policy does not explicitly save, and
the gathers (never saved by those policies) are redone with it.

Compile. Pass ``compiled=True`` when the model will run under ``torch.compile``: the block-level
regions are then left out, because their save-everything policy would override the partitioner's
own choice of activations to save; the per-parameter tags alone make compiled graphs reshard.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

Mode = Literal["replicate", "fully_shard", "hybrid_shard"]

_STORAGE_PLACEMENTS: dict[str, tuple[Placement, ...]] = {
    "replicate": (Replicate(),),
    "fully_shard": (Shard(0),),
    "hybrid_shard": (Replicate(), Shard(0)),
}

# The ops that turn a stored shard into a gathered weight (the functional collectives live in
# their own namespace): the ones to redo in backward instead of keeping their outputs alive.
_CAST_OP = torch.ops.aten._to_copy.default
_COLLECTIVES_NAMESPACE = "_c10d_functional"


def _is_gather_op(op: torch._ops.OpOverload) -> bool:
    return op is _CAST_OP or op.namespace == _COLLECTIVES_NAMESPACE


@dataclass
class _GatherConfig:
    """How one model's parameters are gathered; shared by all the modules of that model."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: bool
    enabled: bool = True


# ---------------------------------------------------------------------------
# The gather
# ---------------------------------------------------------------------------


def _gather(param: DTensor, config: _GatherConfig) -> torch.Tensor:
    """Full local copy of ``param`` in ``param_dtype``; its gradient flows back summed over the mesh."""
    replicated = [Replicate()] * param.device_mesh.ndim
    partial_sum = [Partial("sum")] * param.device_mesh.ndim
    # forward_dtype casts before the all-gather (bf16 on the wire); backward_dtype runs the
    # reduce-scatter / all-reduce in reduce_dtype, and the gradient lands in the param's dtype.
    full = param.redistribute(
        placements=replicated, forward_dtype=config.param_dtype, backward_dtype=config.reduce_dtype
    )
    return full.to_local(grad_placements=partial_sum)


def _gather_region_policy(reshard_after_forward: bool) -> Callable[..., CheckpointPolicy]:
    gather_policy = CheckpointPolicy.MUST_RECOMPUTE if reshard_after_forward else CheckpointPolicy.MUST_SAVE

    def policy(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # Only the gather's own ops carry a decision; the views around them cost nothing either way.
        return gather_policy if _is_gather_op(op) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _block_region_policy(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # Views (the gathered weight's transpose, the collective's slice) alias the gathered buffer:
    # saving one would keep the full weight alive, so they are replayed with the collectives.
    # Casts are saved: the weight's cast runs on the shard, before the all-gather, so it is small,
    # and replaying an activation's cast could read a value changed in place since.
    if op.namespace == _COLLECTIVES_NAMESPACE or op.is_view:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _block_region_contexts() -> tuple[Any, Any]:
    # Saving every op's output includes tensors later updated in place (RMSNorm's `mean` then
    # `add_(eps)`). Only views and collectives of parameters are replayed, so handing back the
    # updated tensor is what the forward saw: allow it instead of raising.
    return create_selective_checkpoint_contexts(_block_region_policy, allow_cache_entry_mutation=True)


def _gathered_parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    param = module._parameters[name]
    config: _GatherConfig = module._simple_fsdp_config
    if not config.enabled:
        return param
    policy = _gather_region_policy(config.reshard_after_forward)
    return checkpoint(
        _gather,
        param,
        config,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        # The gather draws no random numbers.
        preserve_rng_state=False,
    )


# ---------------------------------------------------------------------------
# Class swaps (one cached subclass per original class)
# ---------------------------------------------------------------------------

_GATHERING_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}
_RESHARDING_CLASSES: dict[type, type] = {}


def _gathering_class(cls: type[nn.Module], param_names: tuple[str, ...]) -> type[nn.Module]:
    """``cls`` with a property per parameter name that returns the gathered parameter."""
    key = (cls, param_names)
    if key not in _GATHERING_CLASSES:
        properties = {
            name: property(functools.partial(_gathered_parameter, name=name), doc=f"Gathered `{name}`.")
            for name in param_names
        }
        _GATHERING_CLASSES[key] = type(f"SimpleFSDP{cls.__name__}", (cls,), properties)
    return _GATHERING_CLASSES[key]


def _resharding_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` whose forward runs in a block-level region that re-gathers weights in backward."""
    if cls not in _RESHARDING_CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return checkpoint(
                cls.forward,
                self,
                *args,
                use_reentrant=False,
                context_fn=_block_region_contexts,
                # Only gathers and views are replayed; every random op's output comes from the cache.
                preserve_rng_state=False,
                **kwargs,
            )

        _RESHARDING_CLASSES[cls] = type(f"Resharding{cls.__name__}", (cls,), {"forward": forward})
    return _RESHARDING_CLASSES[cls]


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _shard_parameters(
    model: nn.Module, dp_mesh: DeviceMesh, placements: tuple[Placement, ...], config: _GatherConfig
) -> None:
    sharded: dict[int, nn.Parameter] = {}  # by id of the original: tied parameters stay tied
    for module in model.modules():
        names = tuple(name for name, param in module._parameters.items() if param is not None)
        if not names:
            continue
        for name in names:
            param = module._parameters[name]
            if isinstance(param, DTensor):
                raise NotImplementedError(
                    f"SimpleFSDP over a parameter that is already a DTensor ({name} on "
                    f"{param.device_mesh}, e.g. tensor parallel) is not supported yet"
                )
            if id(param) not in sharded:
                # A meta model has no values to send: every rank takes its own chunk. A materialized
                # one is split from rank 0's copy, so all ranks agree even if their inits differed.
                src_data_rank = None if param.is_meta else 0
                local = distribute_tensor(param.detach(), dp_mesh, placements, src_data_rank=src_data_rank)
                sharded[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            module._parameters[name] = sharded[id(param)]
        module._simple_fsdp_config = config
        module.__class__ = _gathering_class(type(module), names)


def apply_simple_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mode: Mode,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool,
    reshard_blocks: list[nn.Module] | None = None,
    compiled: bool = False,
) -> None:
    """Shards ``model``'s parameters over ``dp_mesh`` in place and gathers them on access.

    Args:
        model: built on the meta device (then ``to_empty`` + init) or already materialized.
        dp_mesh: 1-D for ``replicate`` (DDP) and ``fully_shard`` (FSDP); 2-D
            ``(dp_replicate, dp_shard)`` for ``hybrid_shard`` (HSDP).
        param_dtype: dtype the weights are cast to before gathering (compute dtype).
        reduce_dtype: dtype gradients are reduced in; they are stored in the parameter's dtype.
        reshard_after_forward: free gathered weights after forward and gather again in backward.
            Ignored for ``replicate``: its "gathered" weight is the stored one.
        reshard_blocks: modules (typically the transformer blocks) whose forward runs in a
            block-level region so that resharding also happens in eager. Blocks already wrapped by
            ``checkpoint_wrapper`` are left as they are (their checkpoint already re-gathers).
        compiled: the model will run under ``torch.compile``; no block-level regions are added.

    Gradients are summed over the data-parallel ranks, not averaged.
    """
    placements = _STORAGE_PLACEMENTS[mode]
    if dp_mesh.ndim != len(placements):
        raise ValueError(f"mode {mode!r} needs a {len(placements)}-D mesh, got {dp_mesh.ndim}-D")
    reshard_after_forward = reshard_after_forward and mode != "replicate"
    config = _GatherConfig(param_dtype, reduce_dtype, reshard_after_forward)
    _shard_parameters(model, dp_mesh, placements, config)

    if not reshard_after_forward or compiled:
        return
    for block in reshard_blocks or []:
        if not isinstance(block, CheckpointWrapper):
            block.__class__ = _resharding_class(type(block))


@contextlib.contextmanager
def disable_gathering(model: nn.Module) -> Iterator[None]:
    """Within this context, ``module.weight`` returns the stored (sharded) parameter, not a gathered copy."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "_simple_fsdp_config", None)) is not None}
    previous = {key: config.enabled for key, config in configs.items()}
    for config in configs.values():
        config.enabled = False
    try:
        yield
    finally:
        for key, config in configs.items():
            config.enabled = previous[key]
