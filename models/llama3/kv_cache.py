"""The keys and values of every layer at each position of a batch of sequences, kept between the
forwards of a generation so that each one runs the model on its new tokens only
(``Transformer.forward(tokens, positions, cache=...)``). Under tensor parallelism each rank keeps
its own heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Room for ``length`` positions of ``batch`` sequences. Before each forward, ``start`` takes its
    tokens' positions: each token's keys and values are written at its position, and a token at
    position p attends to the cached positions 0 .. p (slots past p, never written or left by
    padding, are not read)."""

    def __init__(self, batch: int, length: int):
        self.batch = batch
        self.length = length
        self.positions: torch.Tensor | None = None
        self.visible: torch.Tensor | None = None
        self.layers: dict[str, LayerKVCache] = {}

    def start(self, positions: torch.Tensor) -> None:
        """Takes the positions [batch, seq] of the forward about to run, each row's distinct."""
        if positions.shape[0] != self.batch or int(positions.max()) >= self.length or int(positions.min()) < 0:
            raise ValueError(
                f"positions of shape {list(positions.shape)} up to {int(positions.max())} do not fit a cache of "
                f"{self.batch} sequences of {self.length} positions"
            )
        self.positions = positions
        # Keys past the furthest position are read by no token: attention stops there.
        end = int(positions.max()) + 1
        slots = torch.arange(end, device=positions.device)
        self.visible = (slots[None, None, :] <= positions[:, :, None])[:, None]  # [batch, 1, seq, end]

    def layer(self, name: str) -> LayerKVCache:
        """The cache of the layer called ``name``."""
        if name not in self.layers:
            self.layers[name] = LayerKVCache(self)
        return self.layers[name]


class LayerKVCache:
    """One layer's keys and values [batch, length, kv_heads, head_dim], allocated at the first write
    (its heads are the rank's own under tensor parallelism)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Writes ``k``, ``v`` [batch, seq, kv_heads, head_dim] (rotated) at the forward's positions,
        then attends the queries ``q`` [batch, seq, heads, head_dim] to the cached positions each
        may see; returns [batch, seq, heads, head_dim]."""
        cache = self.cache
        if self.keys is None:
            shape = (cache.batch, cache.length, *k.shape[2:])
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        rows = torch.arange(cache.batch, device=k.device)[:, None]
        self.keys[rows, cache.positions] = k
        self.values[rows, cache.positions] = v
        end = cache.visible.shape[-1]
        keys, values = self.keys[:, :end], self.values[:, :end]
        # Query head h reads kv head h // n_rep, as in Attention.
        n_rep = q.shape[2] // keys.shape[2]
        if n_rep > 1:
            keys = keys.repeat_interleave(n_rep, dim=2)
            values = values.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=cache.visible
        )
        return out.transpose(1, 2)
