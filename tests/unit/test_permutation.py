"""Tests of trainer.data.permutation: a keyed bijection on [0, n) that looks shuffled."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data.permutation import KeyedPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 1000, 2**20 + 3])
def test_it_is_a_permutation_of_range_n(n: int) -> None:
    images = KeyedPermutation(n, (0, 0, 0))(np.arange(n))
    assert images.dtype == np.int64
    assert np.array_equal(np.sort(images), np.arange(n))


def test_the_key_chooses_the_permutation_and_fixes_it() -> None:
    n = 1000
    indices = np.arange(n)
    first = KeyedPermutation(n, (1234, 0, 0))(indices)
    assert np.array_equal(first, KeyedPermutation(n, (1234, 0, 0))(indices))
    for other in [(1235, 0, 0), (1234, 1, 0), (1234, 0, 1)]:  # seed, epoch, source
        assert (KeyedPermutation(n, other)(indices) != first).mean() > 0.9, other


def test_it_looks_shuffled() -> None:
    n = 100_000
    indices = np.arange(n)
    images = KeyedPermutation(n, (7, 3, 1))(indices)
    assert abs(np.corrcoef(indices, images)[0, 1]) < 0.02
    assert np.mean(np.diff(images) == 1) < 0.001  # consecutive indices rarely map to consecutive images
    assert (images == indices).sum() < 10  # about one fixed point is expected
    # Every tenth of the range spreads over all tenths of the images, about evenly.
    tenths = np.histogram2d(indices, images, bins=10)[0]
    assert np.all(np.abs(tenths - n / 100) < 0.1 * n / 100)


def test_scalars_and_arrays_give_the_same_images_in_their_shape() -> None:
    permutation = KeyedPermutation(77, (5, 0, 2))
    whole = permutation(np.arange(77))
    assert [int(permutation(i)) for i in range(77)] == whole.tolist()
    assert permutation(np.arange(6).reshape(2, 3)).tolist() == whole[:6].reshape(2, 3).tolist()


def test_indices_outside_the_range_and_an_empty_range_are_refused() -> None:
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 5\)"):
        KeyedPermutation(5, (0,))(np.array([0, 5]))
    with pytest.raises(ValueError, match="needs n >= 1, got n=0"):
        KeyedPermutation(0, (0,))
