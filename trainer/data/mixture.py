"""The global stream of packed windows from a weighted mixture of token sources, sharded over DP ranks and
loader workers, resumable at another DP layout.

Sample ``k`` of the stream comes from the source whose count lags its weight's share of the ``k + 1``
samples the most (ties to the lower index); a source's ``j``-th sample is offset ``j % W`` of its epoch
``j // W`` (``W`` windows), in the order of a permutation keyed by seed, epoch and source. The stream is read
in chunks of the global batch, DP rank ``r`` taking the ``r``-th slice of each. The state is a position in
the global stream and each source's count there: a run resumes with another DP layout of the same global
batch, or at a batch boundary of both."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.data.permutation import KeyedPermutation


class TokenSource(Protocol):
    """A corpus's token stream (``trainer.data.shards.ShardedTokens`` or any reader of the same form)."""

    num_tokens: int

    def tokens(self, start: int, stop: int) -> np.ndarray: ...

    def document_starts(self, start: int, stop: int) -> np.ndarray: ...

    def loss_mask(self, start: int, stop: int) -> np.ndarray | None: ...


def windows_in(source: TokenSource, seq_len: int) -> int:
    """The number of whole windows of ``seq_len + 1`` tokens in ``source``; at least one."""
    windows = source.num_tokens // (seq_len + 1)
    if windows == 0:
        raise ValueError(f"corpus has {source.num_tokens} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
    return windows


def draw_sources(weights: Sequence[float], counts: list[int], length: int) -> list[tuple[int, int]]:
    """The next ``length`` samples after ``counts`` (each source's samples so far; updated) as pairs of
    (source, the source's own sample number)."""
    drawn = sum(counts)
    samples = []
    for total in range(drawn + 1, drawn + length + 1):
        lags = [weight * total - count for weight, count in zip(weights, counts)]
        source = lags.index(max(lags))
        samples.append((source, counts[source]))
        counts[source] += 1
    return samples


def sample_fields(
    window: np.ndarray, document_starts: np.ndarray, loss_mask: np.ndarray | None, *, document_masking: bool
) -> dict[str, torch.Tensor]:
    """One window's inputs and labels (and positions under document masking); ``document_starts`` are the
    offsets in the window where documents begin."""
    tokens = torch.from_numpy(np.asarray(window, dtype=np.int64))
    inputs, labels = tokens[:-1], tokens[1:].clone()
    if loss_mask is not None:
        labels[torch.from_numpy(~np.asarray(loss_mask[1:], dtype=bool))] = IGNORE_INDEX
    fields = {"inputs": inputs, "labels": labels}
    if document_masking:
        seq_len = len(inputs)
        starts = np.asarray(document_starts, dtype=np.int64)
        # The token before a document's start would be trained to predict a document it cannot see.
        labels[torch.from_numpy(starts[starts >= 1] - 1)] = IGNORE_INDEX
        begins = np.zeros(seq_len, dtype=np.int64)
        inside = starts[starts < seq_len]
        begins[inside] = inside
        # Each position's document began at the latest start at or before it (0: before the window).
        fields["positions"] = torch.from_numpy(np.arange(seq_len) - np.maximum.accumulate(begins))
    return fields


class PackedTokenDataset(IterableDataset):
    """This DP rank's share of the global stream, one sample's fields at a time; stateful. Worker ``k`` of
    ``K`` reads every ``K``-th chunk: the loader's round-robin batches keep the single-process order."""

    def __init__(
        self,
        sources: Sequence[TokenSource],
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        weights: Sequence[float] = (),
        document_masking: bool = False,
    ) -> None:
        if weights and (len(weights) != len(sources) or min(weights) <= 0):
            raise ValueError(f"weights {list(weights)} are not one positive weight per source of {len(sources)}")
        weights = weights or [1.0] * len(sources)
        self.sources = list(sources)
        self.source_windows = [windows_in(source, seq_len) for source in self.sources]
        self.num_windows = sum(self.source_windows)
        self.weights = [weight / sum(weights) for weight in weights]
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.global_batch_size = local_batch_size * dp_world_size
        self.seed = seed
        self.document_masking = document_masking
        # Position: the chunk's start, each source's samples before it, samples of this rank's slice
        # yielded, the stride to the next chunk.
        self._chunk_start = 0
        self._source_counts = [0] * len(self.sources)
        self._index_in_slice = 0
        self._chunk_stride = 1
        self._orders: dict[int, tuple[int, KeyedPermutation]] = {}

    def window_ids(self, source: int, numbers: np.ndarray) -> np.ndarray:
        """The windows of ``source``'s samples ``numbers`` (its own count), in its epochs' orders."""
        epochs, offsets = np.divmod(numbers, self.source_windows[source])
        windows = np.empty_like(offsets)
        for epoch in np.unique(epochs).tolist():
            cached_epoch, order = self._orders.get(source, (-1, None))
            if cached_epoch != epoch:
                order = KeyedPermutation(self.source_windows[source], (self.seed, epoch, source))
                self._orders[source] = (epoch, order)
            windows[epochs == epoch] = order(offsets[epochs == epoch])
        return windows

    def sample(self, source: int, window_id: int) -> dict[str, torch.Tensor]:
        reader = self.sources[source]
        start = window_id * (self.seq_len + 1)
        stop = start + self.seq_len + 1
        fields = sample_fields(
            reader.tokens(start, stop),
            reader.document_starts(start, stop) - start if self.document_masking else np.zeros(0, np.int64),
            reader.loss_mask(start, stop),
            document_masking=self.document_masking,
        )
        if len(self.sources) > 1:
            fields["source"] = torch.tensor(source)
        return fields

    def _slice_windows(self) -> list[tuple[int, int]]:
        """(source, window) of each sample of this rank's slice of the chunk at the position."""
        counts = list(self._source_counts)
        draw_sources(self.weights, counts, self.dp_rank * self.local_batch_size)
        samples = np.array(draw_sources(self.weights, counts, self.local_batch_size), dtype=np.int64)
        windows = np.empty(len(samples), dtype=np.int64)
        for source in np.unique(samples[:, 0]).tolist():
            chosen = samples[:, 0] == source
            windows[chosen] = self.window_ids(source, samples[chosen, 1])
        return list(zip(samples[:, 0].tolist(), windows.tolist()))

    def _advance(self, samples: int) -> None:
        draw_sources(self.weights, self._source_counts, samples)
        self._chunk_start += samples

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = get_worker_info()
        num_workers = worker.num_workers if worker is not None else 1
        if self._chunk_stride == 1 and num_workers > 1:
            if self._index_in_slice != 0:
                raise ValueError("data state is inside a batch; it cannot be split across DataLoader workers")
            # A rank-level position fans out: worker k starts k chunks later, its counts drawn through them.
            self._advance(worker.id * self.global_batch_size)
            self._chunk_stride = num_workers
        elif self._chunk_stride != num_workers:
            raise ValueError(
                f"data state was saved by a loader with {self._chunk_stride} workers, "
                f"cannot resume it with num_workers={num_workers if worker else 0}"
            )
        while True:
            for source, window_id in self._slice_windows()[self._index_in_slice :]:
                # Advance before yielding so state_dict() counts this sample as consumed.
                self._index_in_slice += 1
                if self._index_in_slice == self.local_batch_size:
                    self._index_in_slice = 0
                    self._advance(self._chunk_stride * self.global_batch_size)
                yield self.sample(source, window_id)

    def state_dict(self) -> dict[str, int | list[int] | list[float]]:
        """Exact position in the global stream and each source's count there, plus what validates it."""
        return {
            "chunk_start": self._chunk_start,
            "source_counts": list(self._source_counts),
            "index_in_slice": self._index_in_slice,
            "chunk_stride": self._chunk_stride,
            "source_windows": list(self.source_windows),
            "weights": list(self.weights),
            "seed": self.seed,
            "local_batch_size": self.local_batch_size,
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume; the DP layout may differ at a batch boundary of both (a step's end is one)."""
        missing = sorted(self.state_dict().keys() - state_dict.keys())
        if missing:
            raise ValueError(f"data state lacks {', '.join(missing)}: not saved by PackedTokenDataset")
        for name in ("source_windows", "weights", "seed"):
            if state_dict[name] != getattr(self, name):
                raise ValueError(
                    f"data state has {name}={state_dict[name]}, this dataset has {name}={getattr(self, name)}: "
                    "different corpora, weights, tokenizer, seq_len or seed"
                )
        counts = state_dict["source_counts"]
        if sum(counts) != state_dict["chunk_start"] or min(counts) < 0:
            raise ValueError(f"data state's source_counts {counts} do not add up to its chunk_start")
        saved_round = state_dict["local_batch_size"] * state_dict["dp_world_size"]
        at_start_of_a_round = state_dict["index_in_slice"] == 0 and state_dict["chunk_stride"] == 1
        if saved_round != self.global_batch_size and not (
            at_start_of_a_round and state_dict["chunk_start"] % self.global_batch_size == 0
        ):
            raise ValueError(
                f"data state is at sample {state_dict['chunk_start'] + state_dict['index_in_slice']} of batches of "
                f"{saved_round}, where no batch of this loader's {self.global_batch_size} "
                "(dp_world_size * local_batch_size) begins"
            )
        same_layout = saved_round == self.global_batch_size and state_dict["dp_world_size"] == self.dp_world_size
        if state_dict["index_in_slice"] != 0 and not same_layout:
            raise ValueError("data state is inside a batch; it can only resume with the same dp_world_size")
        self._chunk_start = state_dict["chunk_start"]
        self._source_counts = list(counts)
        self._index_in_slice = state_dict["index_in_slice"]
        self._chunk_stride = state_dict["chunk_stride"]


def packed_dataloader(packed: PackedTokenDataset, *, num_workers: int = 0) -> StatefulDataLoader:
    """Resumable loader of ``Batch``es of ``local_batch_size`` windows."""
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that this torch version deprecates.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            packed, batch_size=packed.local_batch_size, num_workers=num_workers, collate_fn=stack_samples
        )


def stack_samples(samples: list[dict[str, torch.Tensor]]) -> Batch:
    stacked = {name: torch.stack([sample[name] for sample in samples]) for name in samples[0]}
    return Batch(
        stacked["inputs"], stacked["labels"], positions=stacked.get("positions"), sources=stacked.get("source")
    )
