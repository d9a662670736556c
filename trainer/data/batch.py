"""What the loader hands the training step: one microbatch of packed windows."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from parallelisms.context_parallel import shard_sequence

# Labels at this id take no loss (cross_entropy's default ignore_index): a chat's non-assistant tokens,
# and under document masking the prediction of the next document's first token.
IGNORE_INDEX = -100


@dataclass
class Batch:
    """``inputs`` and ``labels`` are int64 ``[batch, seq_len]``; ``positions`` (document masking only)
    restart at 0 where a document starts; ``sources`` (int64 ``[batch]``) is each window's source index
    in a mixture of corpora."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    sources: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: t.to(device) if t is not None else None for name, t in moved.items()})

    def context_parallel_shard(self, cp_degree: int, cp_rank: int) -> Batch:
        """The tokens a context-parallel rank keeps: its head and tail chunks of the sequence of the
        inputs, labels and positions (``parallelisms.context_parallel.head_tail_positions``)."""
        if cp_degree == 1:
            return self
        positions = shard_sequence(self.positions, cp_degree, cp_rank) if self.positions is not None else None
        return replace(
            self,
            inputs=shard_sequence(self.inputs, cp_degree, cp_rank),
            labels=shard_sequence(self.labels, cp_degree, cp_rank),
            positions=positions,
        )
