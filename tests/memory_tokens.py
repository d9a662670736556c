"""A token source held in memory, of the form the stream reads (``trainer.data.mixture.TokenSource``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class MemoryTokens:
    """``documents`` concatenated (each a list of ids), with their start offsets and, where given, each
    document's loss mask (1 = a training target)."""

    def __init__(self, documents: Sequence[Sequence[int]], masks: Sequence[Sequence[int]] | None = None) -> None:
        self._tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents])
        self._starts = np.cumsum([0, *map(len, documents[:-1])]).astype(np.int64)
        self._mask = None if masks is None else np.concatenate([np.asarray(m, dtype=bool) for m in masks])
        self.num_tokens = len(self._tokens)
        self.has_loss_mask = masks is not None

    @classmethod
    def arange(cls, num_tokens: int, *, offset: int = 0, document_len: int | None = None) -> MemoryTokens:
        """Tokens ``offset .. offset + num_tokens - 1``, in documents of ``document_len`` (one when unset)."""
        ids = list(range(offset, offset + num_tokens))
        step = document_len or num_tokens
        return cls([ids[i : i + step] for i in range(0, num_tokens, step)])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self._tokens[start:stop]

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        return self._starts[(self._starts >= start) & (self._starts < stop)]

    def loss_mask(self, start: int, stop: int) -> np.ndarray | None:
        return None if self._mask is None else self._mask[start:stop]
