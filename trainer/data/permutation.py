"""A keyed bijection on ``[0, n)``: an epoch's order of a source's windows at no memory per window.

A balanced Feistel network permutes ``[0, 4**h)``, the smallest such range holding ``n`` (at most ``4n``);
an image at or past ``n`` is sent through the network again until it falls below ``n`` (cycle walking),
which keeps the map a bijection on ``[0, n)`` and takes fewer than four passes on average."""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 6
# splitmix64's multipliers: every output bit depends on every input bit.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    z = values * _GOLDEN + key
    z ^= z >> np.uint64(30)
    z *= _MIX_1
    z ^= z >> np.uint64(27)
    z *= _MIX_2
    return z ^ (z >> np.uint64(31))


class KeyedPermutation:
    """A permutation of ``range(n)`` chosen by ``key`` (any ints, e.g. seed, epoch, source); the same
    key and ``n`` give the same permutation on every machine."""

    def __init__(self, n: int, key: tuple[int, ...]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got n={n}")
        self.n = n
        self._half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self._half_bits) - 1)
        digest = hashlib.blake2b(repr(tuple(key)).encode(), digest_size=8 * _ROUNDS).digest()
        self._round_keys = [np.uint64(k) for k in np.frombuffer(digest, dtype="<u8")]

    def __call__(self, indices: np.ndarray | int) -> np.ndarray:
        """The images of ``indices`` (each in ``[0, n)``), int64, in their shape."""
        flat = np.atleast_1d(np.asarray(indices, dtype=np.int64)).ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= self.n):
            raise ValueError(f"indices must lie in [0, {self.n})")
        images = self._network(flat.astype(np.uint64))
        outside = images >= self.n
        while outside.any():
            images[outside] = self._network(images[outside])
            outside = images >= self.n
        return images.astype(np.int64).reshape(np.shape(indices))

    def _network(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self._half_bits)
        left, right = values >> shift, values & self._half_mask
        with np.errstate(over="ignore"):  # the mixing multiplies modulo 2**64 on purpose
            for key in self._round_keys:
                left, right = right, left ^ (_mix(right, key) & self._half_mask)
        return (left << shift) | right
