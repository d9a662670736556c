"""Tensor parallelism (Megatron-style) with sequence parallelism for the Llama 3 model: wq/wk/wv and
w1/w3 split column-wise, wo/w2 row-wise, so attention and the FFN each need one all-gather of their
input and one reduce-scatter of their output; between them the residual stream and the norms stay
sharded on the sequence. The embedding is split by vocabulary row, the output head by column.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallelisms.device import supports_async_tp

# Residual-stream layout between blocks: [batch, seq, dim] sharded on the sequence.
_SEQUENCE_SHARD = Shard(1)


def _block_plan() -> dict[str, ParallelStyle]:
    """The plan of one transformer block (keys relative to the block)."""
    return {
        "attention_norm": SequenceParallel(),
        # Attention and FFN see the whole sequence: all-gather it on entry (rope_cache is left as is).
        "attention": PrepareModuleInput(
            input_layouts=(_SEQUENCE_SHARD, None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=_SEQUENCE_SHARD),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(_SEQUENCE_SHARD,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=_SEQUENCE_SHARD),
    }


def _outer_plan(model: nn.Module, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of the modules around the blocks that this model (or pipeline stage) has."""
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=_SEQUENCE_SHARD),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=_SEQUENCE_SHARD,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # Loss parallel needs to know the logits are vocab-sharded: keep the DTensor.
            use_local_output=not loss_parallel,
        ),
    }
    return {name: style for name, style in plan.items() if getattr(model, name, None) is not None}


def _dims_split_by_tp(model: nn.Module) -> dict[str, int]:
    """The dims the plan splits evenly: whole heads, equal FFN slices, and equal sequence shards
    (sequence parallel passes plain local tensors); the vocabulary may split unevenly."""
    dims = {}
    blocks = list(model.layers.values())
    if blocks:
        attention, feed_forward = blocks[0].attention, blocks[0].feed_forward
        dims["n_heads"] = attention.wq.out_features // attention.head_dim
        dims["n_kv_heads"] = attention.wk.out_features // attention.head_dim
        dims["FFN hidden dim"] = feed_forward.w1.out_features
    # The length of every sequence the model is trained on.
    dims["max_seq_len"] = model.args.max_seq_len
    return dims


def validate_tp(model: nn.Module, tp_degree: int) -> None:
    """Raises a one-line ValueError when ``tp_degree`` does not divide a dim the plan splits evenly."""
    not_divided = [f"{name} {size}" for name, size in _dims_split_by_tp(model).items() if size % tp_degree]
    if not_divided:
        raise ValueError(
            f"tp_degree {tp_degree} must divide the model's n_heads, n_kv_heads and "
            f"FFN hidden dim, and max_seq_len; it does not divide {', '.join(not_divided)}"
        )


def _clone_async_collective_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    # The embedding's reduce-scatter returns an AsyncCollectiveTensor. A compiled block taking it
    # as input breaks autograd (TP alone: backward crashes; FSDP2 x TP: zero embedding gradient).
    # clone() waits and returns a plain tensor while keeping the autograd edge (wait() would cut it).
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def _enable_async_tp(tp_mesh: DeviceMesh) -> None:
    if not supports_async_tp(tp_mesh.device_type):
        raise ValueError(
            "enable_async_tp needs CUDA (symmetric-memory collectives fused "
            f"with matmuls by the compiler); this run is on {tp_mesh.device_type}: turn it off"
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    # Inductor's micro-pipeline pass splits each TP matmul and overlaps its pieces with the collective.
    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool) -> None:
    """Applies tensor + sequence parallelism over ``tp_mesh`` to a Llama ``Transformer`` or a pipeline
    stage of one, in place; call it before activation checkpointing, compile and data parallelism.
    ``loss_parallel`` leaves the logits vocab-sharded (for ``loss_parallel()``), else gathered."""
    validate_tp(model, tp_mesh.size())
    if enable_async_tp:
        _enable_async_tp(tp_mesh)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan())
    parallelize_module(model, tp_mesh, _outer_plan(model, loss_parallel))
    model.hidden_sequence_shards = tp_mesh.size()
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_clone_async_collective_output)


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: loss parallel returns it as a replicated DTensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
