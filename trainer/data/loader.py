"""Token streams and the sharded, resumable stream of packed windows.

The windows form one infinite global stream (epoch ``e``: a permutation seeded with ``seed + e``),
read in chunks of the global batch, DP rank ``r`` taking the ``r``-th slice of each. The state is a
position in the global stream: a run resumes with another DP layout of the same global batch."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from config.errors import user_input
from config.job_config import Training, Validation
from parallelisms.parallel_dims import ParallelDims
from trainer.data.corpus import Corpus, corpus_identity, corpus_of, corpus_texts, create_file_once, pin_revision
from trainer.data.tokenizer import Tokenizer

# Bump when the corpus extraction or the token file layout changes: no stale token stream is reused.
_TOKEN_CACHE_VERSION = 1


def load_token_stream(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str) -> np.ndarray:
    """``corpus``'s tokens, cached under its identity and the tokenizer's fingerprint; memory-mapped."""
    corpus = pin_revision(corpus)  # one question to the hub, for both the key and the documents
    key = json.dumps(
        {
            "version": _TOKEN_CACHE_VERSION,
            "corpus": corpus_identity(corpus),
            "tokenizer": tokenizer.fingerprint,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    path = os.path.join(cache_dir, f"tokens-{digest}.npy")

    def write_tokens(tmp_path: str) -> None:
        # Every document as [bos] + tokens + [eos], concatenated.
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        texts = corpus_texts(corpus)
        documents = [np.asarray(tokenizer.encode(text, bos=True, eos=True), dtype=dtype) for text in texts]
        tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=dtype)
        with open(tmp_path, "wb") as f:  # a file object: np.save(str) would append ".npy"
            np.save(f, tokens)

    create_file_once(path, write_tokens)
    try:
        tokens = np.load(path, mmap_mode="r")
        # An id past the vocabulary would fail every attempt's first step; one pass at memory speed finds it.
        largest = int(tokens.max()) if len(tokens) else 0
        if largest >= tokenizer.vocab_size:
            raise ValueError(f"it holds id {largest}, past the tokenizer's {tokenizer.vocab_size} ids")
    except (ValueError, OSError) as e:  # cut short or overwritten since it was written
        raise ValueError(f"its token cache {path} is damaged ({e}); delete the file and it is rebuilt") from None
    return tokens


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_windows, generator=generator)


class PackedTokenDataset(IterableDataset):
    """This DP rank's share of the global stream of ``(window[:-1], window[1:])``; stateful. Worker ``k``
    of ``K`` reads every ``K``-th chunk: the loader's round-robin batches keep the single-process order."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
    ) -> None:
        window_len = seq_len + 1
        self.num_windows = len(tokens) // window_len
        if self.num_windows == 0:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one window of seq_len + 1 = {window_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.global_batch_size = local_batch_size * dp_world_size
        self.seed = seed
        # Position: the chunk's start, samples of this rank's slice yielded, the stride to the next chunk.
        self._chunk_start = 0
        self._index_in_slice = 0
        self._chunk_stride = 1
        self._permutation_epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def window_id(self, global_position: int) -> int:
        epoch, offset = divmod(global_position, self.num_windows)
        if epoch != self._permutation_epoch:
            self._permutation = epoch_permutation(self.num_windows, self.seed, epoch)
            self._permutation_epoch = epoch
        return int(self._permutation[offset])

    def window(self, window_id: int) -> torch.Tensor:
        window_len = self.seq_len + 1
        start = window_id * window_len
        return torch.from_numpy(np.asarray(self.tokens[start : start + window_len], dtype=np.int64))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        worker = get_worker_info()
        num_workers = worker.num_workers if worker is not None else 1
        if self._chunk_stride == 1 and num_workers > 1:
            if self._index_in_slice != 0:
                raise ValueError("data state is inside a batch; it cannot be split across DataLoader workers")
            # A rank-level position fans out: worker k starts k chunks later.
            self._chunk_start += worker.id * self.global_batch_size
            self._chunk_stride = num_workers
        elif self._chunk_stride != num_workers:
            raise ValueError(
                f"data state was saved by a loader with {self._chunk_stride} workers, "
                f"cannot resume it with num_workers={num_workers if worker else 0}"
            )
        while True:
            position = self._chunk_start + self.dp_rank * self.local_batch_size + self._index_in_slice
            window_id = self.window_id(position)
            # Advance before yielding so state_dict() counts this sample as consumed.
            self._index_in_slice += 1
            if self._index_in_slice == self.local_batch_size:
                self._index_in_slice = 0
                self._chunk_start += self._chunk_stride * self.global_batch_size
            window = self.window(window_id)
            yield window[:-1], window[1:]

    def state_dict(self) -> dict[str, int]:
        """Exact position in the global stream, plus what validates it on load."""
        return {
            "chunk_start": self._chunk_start,
            "index_in_slice": self._index_in_slice,
            "chunk_stride": self._chunk_stride,
            "num_windows": self.num_windows,
            "seed": self.seed,
            "local_batch_size": self.local_batch_size,
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume; the DP layout may differ at a batch boundary of both (a step's end is one)."""
        missing = sorted(self.state_dict().keys() - state_dict.keys())
        if missing:
            raise ValueError(f"data state lacks {', '.join(missing)}: not saved by PackedTokenDataset")
        for name in ("num_windows", "seed"):
            if state_dict[name] != getattr(self, name):
                raise ValueError(
                    f"data state has {name}={state_dict[name]}, this dataset has "
                    f"{name}={getattr(self, name)}: different corpus, tokenizer, seq_len or seed"
                )
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
        self._index_in_slice = state_dict["index_in_slice"]
        self._chunk_stride = state_dict["chunk_stride"]


def build_dataset(corpus: Corpus, tokenizer: Tokenizer, *, cache_dir: str, **layout: int) -> PackedTokenDataset:
    """This DP rank's dataset of ``corpus``; ``layout``: PackedTokenDataset's keyword arguments."""
    tokens = load_token_stream(corpus, tokenizer, cache_dir)
    try:
        return PackedTokenDataset(tokens, **layout)
    except ValueError as error:
        raise ValueError(f"dataset {corpus.dataset}: {error}") from None


def config_dataloader(
    option: str,
    section: Training | Validation,
    training: Training,
    tokenizer: Tokenizer,
    parallel_dims: ParallelDims,
    *,
    seed: int,
    cache_dir: str,
) -> StatefulDataLoader:
    """This DP rank's loader of ``section``'s corpus; validation takes training's shape where it sets none."""
    with user_input(option):
        dataset = build_dataset(
            corpus_of(section),
            tokenizer,
            seq_len=section.seq_len or training.seq_len,
            local_batch_size=section.local_batch_size or training.local_batch_size,
            dp_rank=parallel_dims.dp_rank,
            dp_world_size=parallel_dims.dp_degree,
            seed=seed,
            cache_dir=cache_dir,
        )
        return packed_dataloader(dataset, num_workers=training.dataloader_num_workers)


def packed_dataloader(packed: PackedTokenDataset, *, num_workers: int = 0) -> StatefulDataLoader:
    """Resumable loader of int64 ``[local_batch_size, seq_len]`` inputs and labels."""
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that this torch version deprecates.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            packed, batch_size=packed.local_batch_size, num_workers=num_workers, collate_fn=stack_samples
        )


def stack_samples(samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack(field) for field in zip(*samples))
