"""Activation checkpointing: recompute a block's activations in backward instead of storing them."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch._inductor.custom_graph_pass import get_hash_for_files
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Compute-heavy ops whose outputs are worth keeping under selective op-level checkpointing.
_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _op_policy_context():
    mm_count = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            mm_count[mode] += 1
            # Every other matmul is recomputed: half the matmul memory for a quarter more compute.
            if mm_count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# Lets torch's AOT autograd cache keep compiled graphs holding this region (it skips them without one).
_op_policy_context.cache_hash = get_hash_for_files((__file__,), "op-level policy")


def apply_ac(
    blocks: nn.ModuleDict,
    mode: str,
    selective_option: str = "op",
    *,
    early_stop: bool = True,
    preserve_rng_state: bool = False,
    determinism_check: str = "default",
    debug: bool = False,
) -> None:
    """Wraps ``blocks`` for activation checkpointing in place: ``full`` every block; ``selective``
    ``op`` saves matmul and attention outputs (every other matmul recomputed), ``N`` every N-th
    block; ``none`` and ``memory_budget`` (the partitioner chooses) nothing."""
    if mode in ("none", "memory_budget"):
        return
    wrap = functools.partial(
        checkpoint_wrapper,
        early_stop=early_stop,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
    )
    for name, block in list(blocks.items()):
        if mode == "full":
            wrapped = wrap(block)
        elif selective_option == "op":
            wrapped = wrap(block, context_fn=_op_policy_context)
        # Counted by the block's number in the model, not on this pipeline stage, which holds a
        # part of them: every N-th block is the same blocks under any split.
        elif (int(name) + 1) % int(selective_option) == 0:
            wrapped = wrap(block)
        else:
            continue
        blocks[name] = wrapped
