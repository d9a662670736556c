"""Text corpora, token packing and the sharded, resumable training data stream.

The packed windows of a corpus form one infinite *global stream*: epoch ``e``
is the permutation of all window indices drawn from a generator seeded with
``seed + e``, and epochs follow each other forever. The data-parallel group
reads the stream in chunks of ``dp_world_size * local_batch_size`` samples and
DP rank ``r`` takes the ``r``-th slice of ``local_batch_size`` samples of each
chunk. State is a position in the global stream, so a run can resume with a
different DP layout (same global batch) without losing or repeating samples.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.tokenizer import Tokenizer, create_file_once

DEFAULT_DATASET = "python_docs"
CORPUS_SUFFIXES = (".txt", ".jsonl")

# Bump when the corpus extraction or the token file layout changes, so stale
# cached token streams are not reused.
_TOKEN_CACHE_VERSION = 1
# Folders of the standard library that hold tests, test data or third-party code.
_SKIPPED_STDLIB_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def default_corpus_texts() -> Iterator[str]:
    """Documents of the default corpus, available wherever Python is installed.

    First the interpreter's help topics (``pydoc_data.topics``, one document
    per topic, sorted by name), then one document per standard-library module
    (its docstrings in source order; folders walked in sorted order). Modules are
    parsed with ``ast``, never imported, since some have import side effects.
    """
    return iter(_default_corpus_documents())


@functools.cache
def _default_corpus_documents() -> tuple[str, ...]:
    # Parsing the stdlib takes seconds and both the default tokenizer and the
    # token stream need it on first use; the text is only a few MB.
    return tuple(_python_docs())


def _python_docs() -> Iterator[str]:
    try:
        topics: dict[str, str] = importlib.import_module("pydoc_data.topics").topics
    except ImportError:  # some distributions package pydoc_data separately
        topics = {}
    for name in sorted(topics):
        yield topics[name]
    yield from _stdlib_docstrings(Path(sysconfig.get_path("stdlib")))


def _stdlib_docstrings(stdlib_root: Path) -> Iterator[str]:
    for directory, subdirectories, file_names in os.walk(stdlib_root):
        # Pruning and sorting in place steers os.walk: deterministic order.
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_STDLIB_DIRS)
        for file_name in sorted(file_names):
            if not file_name.endswith(".py") or file_name.startswith("test_"):
                continue
            source = Path(directory, file_name).read_bytes()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # invalid escape sequences in old modules
                    tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue  # templates and data files that are not valid Python
            docstrings = list(_docstrings_in_source_order(tree))
            if docstrings:
                yield "\n\n".join(docstrings)


def _docstrings_in_source_order(node: ast.AST) -> Iterator[str]:
    if isinstance(node, _DOCUMENTED_NODES):
        docstring = ast.get_docstring(node)
        if docstring:
            yield docstring
    for child in ast.iter_child_nodes(node):
        yield from _docstrings_in_source_order(child)


def local_corpus_texts(path: str) -> Iterator[str]:
    """Documents of a local corpus: a ``.txt`` file (one document), a ``.jsonl``
    file (one document per line, from its ``text`` field) or a folder of such
    files (recursively, in sorted order)."""
    for file_path in local_corpus_files(path):
        if file_path.suffix == ".txt":
            yield _read_text(file_path)
        else:
            yield from _jsonl_texts(file_path)


def local_corpus_files(path: str) -> list[Path]:
    """The ``.txt``/``.jsonl`` files that make up the corpus at ``path``."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"dataset path not found: {path}")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file())
        if not files:
            raise ValueError(f"dataset folder {path} contains no .txt or .jsonl files")
        return files
    if root.suffix not in CORPUS_SUFFIXES:
        raise ValueError(f"dataset file {path} is neither .txt nor .jsonl")
    return [root]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def _jsonl_texts(path: Path) -> Iterator[str]:
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number}: invalid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{line_number}: expected an object with a string 'text' field")
        yield record["text"]


def corpus_texts(dataset: str) -> Iterator[str]:
    """Documents of ``dataset``: ``"python_docs"`` or a local corpus path."""
    if dataset == DEFAULT_DATASET:
        return default_corpus_texts()
    return local_corpus_texts(dataset)


def _corpus_identity(dataset: str) -> dict[str, Any]:
    """What the corpus content depends on, cheap to compute (no reading)."""
    if dataset == DEFAULT_DATASET:
        return {"name": dataset, "python": sys.version, "stdlib": sysconfig.get_path("stdlib")}
    files = local_corpus_files(dataset)
    return {"files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def tokenize_corpus(texts: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """One token stream: every document as ``[bos] + tokens + [eos]``, concatenated."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    documents = [np.asarray(tokenizer.encode(text, bos=True, eos=True), dtype=dtype) for text in texts]
    if not documents:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(documents)


def load_token_stream(dataset: str, tokenizer: Tokenizer, cache_dir: str) -> np.ndarray:
    """Token stream of ``dataset``, tokenized once and cached in ``cache_dir``.

    The cache key covers the corpus identity (files, sizes, mtimes; or the
    Python build for the default corpus) and the tokenizer fingerprint. The
    returned array is memory-mapped and read-only.
    """
    key = json.dumps(
        {
            "version": _TOKEN_CACHE_VERSION,
            "corpus": _corpus_identity(dataset),
            "tokenizer": tokenizer.fingerprint,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    path = os.path.join(cache_dir, f"tokens-{digest}.npy")

    def write_tokens(tmp_path: str) -> None:
        tokens = tokenize_corpus(corpus_texts(dataset), tokenizer)
        with open(tmp_path, "wb") as f:  # a file object: np.save(str) would append ".npy"
            np.save(f, tokens)

    create_file_once(path, write_tokens)
    return np.load(path, mmap_mode="r")


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """Order of the window indices in ``epoch`` of the global stream."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_windows, generator=generator)


class PackedTokenDataset(IterableDataset):
    """This DP rank's share of the infinite global stream of packed windows.

    Window ``w`` is ``tokens[w * (seq_len + 1) : (w + 1) * (seq_len + 1)]``;
    a sample is ``(window[:-1], window[1:])`` as int64 tensors, plus the window
    index when ``return_window_ids`` is set.

    Implements ``state_dict``/``load_state_dict`` (torchdata's Stateful
    protocol). With DataLoader workers, worker ``k`` of ``K`` reads every
    ``K``-th chunk, which makes the loader's round-robin batch order equal the
    single-process order (it must batch with ``batch_size=local_batch_size``).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        return_window_ids: bool = False,
    ) -> None:
        _check_positive("seq_len", seq_len)
        _check_positive("local_batch_size", local_batch_size)
        _check_positive("dp_world_size", dp_world_size)
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_world_size={dp_world_size})")
        window_len = seq_len + 1
        self.num_windows = len(tokens) // window_len
        if self.num_windows == 0:
            raise ValueError(
                f"corpus has {len(tokens)} tokens, fewer than one window of seq_len + 1 = {window_len}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.global_batch_size = local_batch_size * dp_world_size
        self.seed = seed
        self.return_window_ids = return_window_ids
        # Position of this iterator: global-stream index where its current chunk
        # starts, samples of this rank's slice of it already yielded, and the
        # distance to its next chunk in chunks (K for a DataLoader worker's
        # stream, 1 for the whole rank's stream).
        self._chunk_start = 0
        self._index_in_slice = 0
        self._chunk_stride = 1
        self._permutation_epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def window_id(self, global_position: int) -> int:
        """Window index at ``global_position`` of the global stream."""
        epoch, offset = divmod(global_position, self.num_windows)
        if epoch != self._permutation_epoch:
            self._permutation = epoch_permutation(self.num_windows, self.seed, epoch)
            self._permutation_epoch = epoch
        return int(self._permutation[offset])

    def window(self, window_id: int) -> torch.Tensor:
        """Tokens of window ``window_id`` (``seq_len + 1`` int64 values)."""
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
            if self.return_window_ids:
                yield window[:-1], window[1:], torch.tensor(window_id)
            else:
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
        """Resume from ``state_dict``; the DP layout may differ if the global
        batch size is the same and the state is at a batch boundary."""
        missing = sorted(self.state_dict().keys() - state_dict.keys())
        if missing:
            raise ValueError(f"data state lacks {', '.join(missing)}: not saved by PackedTokenDataset")
        for name in ("num_windows", "seed"):
            if state_dict[name] != getattr(self, name):
                raise ValueError(
                    f"data state has {name}={state_dict[name]}, this dataset has "
                    f"{name}={getattr(self, name)}: different corpus, tokenizer, seq_len or seed"
                )
        saved_global_batch = state_dict["local_batch_size"] * state_dict["dp_world_size"]
        if saved_global_batch != self.global_batch_size:
            raise ValueError(
                f"data state has global batch size {saved_global_batch}, "
                f"this loader has {self.global_batch_size} (dp_world_size * local_batch_size)"
            )
        same_layout = (state_dict["local_batch_size"], state_dict["dp_world_size"]) == (
            self.local_batch_size,
            self.dp_world_size,
        )
        if state_dict["index_in_slice"] != 0 and not same_layout:
            raise ValueError("data state is inside a batch; it can only resume with the same dp_world_size")
        self._chunk_start = state_dict["chunk_start"]
        self._index_in_slice = state_dict["index_in_slice"]
        self._chunk_stride = state_dict["chunk_stride"]


def build_dataset(
    dataset: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    cache_dir: str,
    return_window_ids: bool = False,
) -> PackedTokenDataset:
    """This DP rank's dataset of ``dataset`` (``"python_docs"`` or a local path)."""
    tokens = load_token_stream(dataset, tokenizer, cache_dir)
    try:
        return PackedTokenDataset(
            tokens,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seed=seed,
            return_window_ids=return_window_ids,
        )
    except ValueError as error:
        raise ValueError(f"dataset {dataset}: {error}") from None


def build_dataloader(
    dataset: str, tokenizer: Tokenizer, *, num_workers: int = 0, **dataset_options: Any
) -> StatefulDataLoader:
    """Resumable loader of ``(inputs, labels)`` int64 batches ``[local_batch_size, seq_len]``
    (plus ``window_ids [local_batch_size]`` when ``return_window_ids``); ``dataset_options`` are
    ``build_dataset``'s."""
    return packed_dataloader(build_dataset(dataset, tokenizer, **dataset_options), num_workers=num_workers)


def packed_dataloader(packed: PackedTokenDataset, *, num_workers: int = 0) -> StatefulDataLoader:
    """Resumable loader batching ``packed`` by its ``local_batch_size``."""
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be >= 0")
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that this torch version deprecates.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            packed, batch_size=packed.local_batch_size, num_workers=num_workers, collate_fn=stack_samples
        )


def stack_samples(samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Collate samples into a tuple of batched tensors."""
    return tuple(torch.stack(field) for field in zip(*samples))


def _check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")
