"""Context parallelism in the Llama 3 model: what each block's attention needs to attend over the
sequence split across the context-parallel ranks (``parallelisms.context_parallel``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms.context_parallel import (
    RotateMethod,
    context_parallel_attention,
    document_ids,
    head_tail_positions,
)


@dataclass(frozen=True)
class ContextParallel:
    """The context-parallel group a model's sequence is split over."""

    group: dist.ProcessGroup
    degree: int
    rank: int
    rotate_method: RotateMethod


@dataclass(frozen=True)
class ContextParallelMask:
    """Attention's mask under context parallelism: the global positions of this rank's tokens
    [seq_local], and with document masking each token's document id [batch, seq_local]."""

    context_parallel: ContextParallel
    positions: torch.Tensor
    documents: torch.Tensor | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp = self.context_parallel
        return context_parallel_attention(q, k, v, self.positions, cp.group, cp.rotate_method, self.documents)


def context_parallel_inputs(
    cp: ContextParallel, seq_local: int, rope_cache: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, ContextParallelMask]:
    """The rotary rows of this rank's tokens ([1 or batch, seq_local, head_dim]: at their global
    positions, or at ``positions`` in their documents) and attention's mask."""
    tokens = head_tail_positions(seq_local * cp.degree, cp.degree, cp.rank, rope_cache.device)
    if positions is None:
        return rope_cache[tokens][None], ContextParallelMask(cp, tokens, None)
    return rope_cache[positions], ContextParallelMask(cp, tokens, document_ids(tokens, positions))


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh | None, rotate_method: RotateMethod) -> None:
    """Splits the sequence of ``model`` (a Transformer or a pipeline stage of one) over ``cp_mesh``
    (None: no context parallelism): its forward then takes this rank's chunks
    (``Batch.context_parallel_shard``)."""
    if cp_mesh is None:
        return
    model.context_parallel = ContextParallel(
        cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), rotate_method
    )
