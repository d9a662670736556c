"""Tests of trainer.data.mixture: the global stream of windows from a weighted mixture of token sources,
its Batches, and its exact position across DP layouts and loader workers."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch

from tests.memory_tokens import MemoryTokens
from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.data.mixture import PackedTokenDataset, draw_sources, packed_dataloader
from trainer.data.permutation import KeyedPermutation

SEQ_LEN = 3
WINDOW = SEQ_LEN + 1
NUM_WINDOWS = 7
SEED = 1234
# Three sources of 50, 70 and 33 windows; source s's window w begins with token SOURCE_BASE * s + 4 * w.
SOURCE_BASE = 10_000
SOURCE_WINDOWS = [50, 70, 33]
WEIGHTS = [0.5, 0.3, 0.2]


def arange_loader(*, local_batch_size: int, dp_rank: int = 0, dp_world_size: int = 1, num_workers: int = 0):
    """One source whose window ``w`` holds the tokens ``w * 4 .. w * 4 + 3``."""
    dataset = PackedTokenDataset(
        [MemoryTokens.arange(NUM_WINDOWS * WINDOW + 2)],  # +2: dropped remainder
        seq_len=SEQ_LEN,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=SEED,
    )
    return packed_dataloader(dataset, num_workers=num_workers)


def mixture_dataset(*, local_batch_size: int, dp_rank: int = 0, dp_world_size: int = 1, **options):
    sources = [MemoryTokens.arange(n * WINDOW + 1, offset=SOURCE_BASE * s) for s, n in enumerate(SOURCE_WINDOWS)]
    layout = dict(local_batch_size=local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    return PackedTokenDataset(sources, weights=WEIGHTS, seq_len=SEQ_LEN, seed=SEED, **layout, **options)


def mixture_loader(*, num_workers: int = 0, **layout: int):
    return packed_dataloader(mixture_dataset(**layout), num_workers=num_workers)


def global_order(length: int) -> list[int]:
    """The first ``length`` window ids of a one-source stream, computed directly."""
    order: list[int] = []
    epoch = 0
    while len(order) < length:
        order += KeyedPermutation(NUM_WINDOWS, (SEED, epoch, 0))(np.arange(NUM_WINDOWS)).tolist()
        epoch += 1
    return order[:length]


def take_window_ids(batches, steps: int) -> list[list[int]]:
    """The window ids of the next ``steps`` batches of an ``arange_loader``."""
    return [(next(batches).inputs[:, 0] // WINDOW).tolist() for _ in range(steps)]


def take_samples(batches, steps: int) -> list[list[tuple[int, int]]]:
    """(source, window) of each sample of the next ``steps`` batches of a mixture loader."""
    taken = []
    for _ in range(steps):
        batch = next(batches)
        first = batch.inputs[:, 0]
        assert batch.sources.tolist() == (first // SOURCE_BASE).tolist()
        taken.append(list(zip((first // SOURCE_BASE).tolist(), (first % SOURCE_BASE // WINDOW).tolist())))
    return taken


def steps_at(dp_world_size: int, global_batch: int, steps: int, state: dict | None = None):
    """``steps`` global batches read by ``dp_world_size`` ranks (rank slices concatenated), from ``state``;
    and the state after them (rank 0's, as a checkpoint keeps it)."""
    loaders = [
        mixture_loader(local_batch_size=global_batch // dp_world_size, dp_rank=r, dp_world_size=dp_world_size)
        for r in range(dp_world_size)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(copy.deepcopy(state))
    per_rank = [take_samples(iter(loader), steps) for loader in loaders]
    return [sum((rank[step] for rank in per_rank), []) for step in range(steps)], loaders[0].state_dict()


# --- the mixture -------------------------------------------------------------


def test_each_source_keeps_within_one_sample_of_its_weight() -> None:
    counts = [0, 0, 0]
    for drawn in range(1, 5001):
        draw_sources(WEIGHTS, counts, 1)
        assert max(abs(count - weight * drawn) for count, weight in zip(counts, WEIGHTS)) < 1, drawn
    # Lags at sample 5: 2.5 - 2, 1.5 - 1, 1 - 1: a tie, to the lower index. A source's own numbers count
    # up from 0; drawn in one call or in several, the same samples.
    first_five = [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2)]
    assert draw_sources(WEIGHTS, [0, 0, 0], 5) == first_five
    counts = [0, 0, 0]
    assert draw_sources(WEIGHTS, counts, 2) + draw_sources(WEIGHTS, counts, 3) == first_five


def test_shares_follow_the_weights_and_survive_a_resume_at_another_dp_degree() -> None:
    """200 steps of a global batch of 8 from three sources at 0.5, 0.3, 0.2; stopped after 100 steps on 2
    ranks and resumed on 1 and on 4: the same samples in the same order, so the same shares."""
    uninterrupted, _ = steps_at(1, 8, 200)
    samples = sum(uninterrupted, [])
    shares = Counter(source for source, _ in samples)
    for source, weight in enumerate(WEIGHTS):
        assert abs(shares[source] / len(samples) - weight) < 0.01, (source, shares)
    # Each source reads its windows in its own epochs: every window once per epoch.
    for source, windows in enumerate(SOURCE_WINDOWS):
        own = [window for s, window in samples if s == source]
        for epoch in range(len(own) // windows):
            assert sorted(own[epoch * windows : (epoch + 1) * windows]) == list(range(windows)), (source, epoch)

    first_half, state = steps_at(2, 8, 100)
    assert first_half == uninterrupted[:100]
    for dp_world_size in (1, 4):
        second_half, _ = steps_at(dp_world_size, 8, 100, state)
        assert second_half == uninterrupted[100:], dp_world_size
        resumed = sum(first_half + second_half, [])
        for source in range(len(WEIGHTS)):  # every sample of each source read exactly once, none lost
            assert Counter(s for s in resumed if s[0] == source) == Counter(s for s in samples if s[0] == source)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_workers_and_dp_ranks_read_the_single_process_mixture(num_workers: int) -> None:
    """Each worker draws the mixture through the chunks it skips: their batches interleave into the
    single process's."""
    single = take_samples(iter(mixture_loader(local_batch_size=6)), 9)
    ranks = [
        take_samples(iter(mixture_loader(local_batch_size=3, dp_rank=r, dp_world_size=2, num_workers=num_workers)), 9)
        for r in range(2)
    ]
    assert [ranks[0][step] + ranks[1][step] for step in range(9)] == single


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_mixture_resumes_inside_a_batch_and_with_workers(num_workers: int) -> None:
    loader = mixture_loader(local_batch_size=3, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    batches = iter(loader)
    take_samples(batches, 5)
    state = copy.deepcopy(loader.state_dict())
    uninterrupted = take_samples(batches, 6)
    resumed = mixture_loader(local_batch_size=3, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert take_samples(iter(resumed), 6) == uninterrupted


# --- one source ----------------------------------------------------------------


def test_one_source_follows_its_epoch_orders_and_yields_shifted_windows() -> None:
    batches = iter(arange_loader(local_batch_size=3))
    ids = sum(take_window_ids(batches, 5), [])  # 15 samples span three epochs of 7
    assert ids == global_order(15)
    batch = next(batches)
    assert isinstance(batch, Batch) and batch.positions is None and batch.sources is None
    assert batch.inputs.dtype == batch.labels.dtype == torch.int64
    windows = (batch.inputs[:, 0] // WINDOW).tolist()
    assert batch.inputs.tolist() == [[WINDOW * w + i for i in range(SEQ_LEN)] for w in windows]
    assert batch.labels.tolist() == [[WINDOW * w + 1 + i for i in range(SEQ_LEN)] for w in windows]


def test_dp_ranks_concatenated_equal_single_rank_with_double_batch() -> None:
    single = iter(arange_loader(local_batch_size=4))
    ranks = [iter(arange_loader(local_batch_size=2, dp_rank=r, dp_world_size=2)) for r in range(2)]
    for _ in range(6):
        expected = next(single)
        per_rank = [next(rank) for rank in ranks]
        assert torch.equal(torch.cat([batch.inputs for batch in per_rank]), expected.inputs)
        assert torch.equal(torch.cat([batch.labels for batch in per_rank]), expected.labels)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("steps_before_save", [1, 3])  # 3 * 3 samples crosses an epoch of 7
def test_resume_yields_the_uninterrupted_batches(num_workers: int, steps_before_save: int) -> None:
    loader = arange_loader(local_batch_size=3, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    batches = iter(loader)
    before = take_window_ids(batches, steps_before_save)
    state = copy.deepcopy(loader.state_dict())
    uninterrupted = take_window_ids(batches, 4)

    resumed_loader = arange_loader(local_batch_size=3, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    resumed_loader.load_state_dict(state)
    assert take_window_ids(iter(resumed_loader), 4) == uninterrupted

    # Rank 1 reads samples 3..5 of every chunk of 6 in the global order.
    order = global_order(6 * (steps_before_save + 4))
    expected = [order[6 * step + 3 : 6 * step + 6] for step in range(steps_before_save + 4)]
    assert before + uninterrupted == expected


def test_resume_with_different_dp_world_size_continues_global_order() -> None:
    # 3 steps at dp=1 x 4, then 4 steps at dp=2 x 2, then 3 steps at dp=1 x 4:
    # 40 samples = 40 positions of the global stream, none lost or repeated.
    single = arange_loader(local_batch_size=4)
    batches = iter(single)
    consumed = sum(take_window_ids(batches, 3), [])

    ranks = [arange_loader(local_batch_size=2, dp_rank=r, dp_world_size=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(copy.deepcopy(single.state_dict()))
    rank_batches = [iter(rank) for rank in ranks]
    for _ in range(4):
        for batch in rank_batches:
            consumed += take_window_ids(batch, 1)[0]

    resumed_single = arange_loader(local_batch_size=4)
    resumed_single.load_state_dict(copy.deepcopy(ranks[1].state_dict()))
    consumed += sum(take_window_ids(iter(resumed_single), 3), [])

    assert consumed == global_order(40)
    counts = Counter(consumed[:35])  # exactly five epochs of 7 windows
    assert counts == {window: 5 for window in range(NUM_WINDOWS)}


# --- Batch -------------------------------------------------------------------------


def hand_batches(document_masking: bool) -> dict[int, Batch]:
    """The two windows of seq_len 5 over documents [1 2 3] [4 5 6 7] [8 9 10 11 12] with loss masks
    [0 1 1] [0 0 1 1] [1 1 1 0 1], by each row's first token."""
    source = MemoryTokens(
        [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]], masks=[[0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0, 1]]
    )
    dataset = PackedTokenDataset(
        [source],
        seq_len=5,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        seed=0,
        document_masking=document_masking,
    )
    batch = next(iter(packed_dataloader(dataset)))
    rows = {int(first): row for row, first in enumerate(batch.inputs[:, 0])}
    return {
        first: Batch(
            batch.inputs[row],
            batch.labels[row],
            None if batch.positions is None else batch.positions[row],
        )
        for first, row in rows.items()
    }


def test_labels_and_positions_match_a_hand_computation() -> None:
    ignored = IGNORE_INDEX
    # Window 0 = tokens 1..6: documents start at offsets 0 and 3; window 1 = tokens 7..12: one starts at
    # offset 1, and the document of token 7 began before the window.
    masked = hand_batches(document_masking=True)
    assert masked[1].inputs.tolist() == [1, 2, 3, 4, 5]
    assert masked[1].labels.tolist() == [2, 3, ignored, ignored, 6]  # 4, 5: loss mask 0; 3 -> 4 also a start
    assert masked[1].positions.tolist() == [0, 1, 2, 0, 1]
    assert masked[7].inputs.tolist() == [7, 8, 9, 10, 11]
    assert masked[7].labels.tolist() == [ignored, 9, 10, ignored, 12]  # 7 -> 8 crosses into a document
    assert masked[7].positions.tolist() == [0, 0, 1, 2, 3]
    plain = hand_batches(document_masking=False)
    assert plain[1].labels.tolist() == [2, 3, ignored, ignored, 6]
    assert plain[7].labels.tolist() == [8, 9, 10, ignored, 12]  # only the loss mask
    assert plain[7].positions is None


# --- state -----------------------------------------------------------------------


def test_state_mismatch_is_rejected() -> None:
    dataset = mixture_dataset(local_batch_size=2)
    state = dataset.state_dict()
    for name, value in [("seed", SEED + 1), ("weights", [0.4, 0.4, 0.2]), ("source_windows", [50, 70, 34])]:
        with pytest.raises(ValueError, match=f"data state has {name}="):
            mixture_dataset(local_batch_size=2).load_state_dict({**state, name: value})
    with pytest.raises(ValueError, match=r"source_counts \[1, 0, 0\] do not add up to its chunk_start"):
        mixture_dataset(local_batch_size=2).load_state_dict({**state, "source_counts": [1, 0, 0]})
    # Batches of 2 into batches of 4 (gradient accumulation at one layout, none at another): at
    # sample 2 no batch of 4 begins; at sample 4 one does.
    with pytest.raises(ValueError, match="at sample 2 of batches of 2, where no batch of this loader's 4"):
        mixture_dataset(local_batch_size=4).load_state_dict({**state, "chunk_start": 2, "source_counts": [1, 1, 0]})
    mixture_dataset(local_batch_size=4).load_state_dict({**state, "chunk_start": 4, "source_counts": [2, 1, 1]})
    with pytest.raises(ValueError, match="lacks chunk_start"):
        state_without_position = {k: v for k, v in state.items() if k != "chunk_start"}
        mixture_dataset(local_batch_size=2).load_state_dict(state_without_position)
    with pytest.raises(ValueError, match="inside a batch"):
        mixture_dataset(local_batch_size=1, dp_world_size=2).load_state_dict({**state, "index_in_slice": 1})


def test_a_position_saved_by_a_worker_resumes_only_in_as_many_workers() -> None:
    """(The checkpoint refuses another training.dataloader_num_workers first; this is the loader's own check.)"""
    dataset = mixture_dataset(local_batch_size=2)
    state = {**dataset.state_dict(), "chunk_start": 2, "source_counts": [1, 1, 0], "chunk_stride": 2}
    dataset.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by a loader with 2 workers, cannot resume it with num_workers=0"):
        next(iter(dataset))


def test_a_source_shorter_than_one_window_and_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^corpus has 5 tokens, fewer than one window of seq_len \+ 1 = 9$"):
        PackedTokenDataset(
            [MemoryTokens.arange(100), MemoryTokens.arange(5)],
            seq_len=8,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
        )
    with pytest.raises(ValueError, match=r"weights \[1.0, 0.0\] are not one positive weight per source of 2"):
        PackedTokenDataset(
            [MemoryTokens.arange(100)] * 2,
            weights=[1.0, 0.0],
            seq_len=8,
            local_batch_size=1,
            dp_rank=0,
            dp_world_size=1,
            seed=0,
        )
