"""Token shards: a corpus tokenized once, in parallel, into numbered shard files under
``<cache_dir>/tokens-<digest>/``, and read back through memory maps.

Each piece of the corpus (``corpus_pieces``; a hub dataset: every HUB_SHARD_DOCUMENTS records of its
stream) becomes shard ``NNNNN``: ``shard-NNNNN.tokens`` (uint16, or uint32 past 65536 ids), ``.docs``
(int64 start of each document in the shard), ``.mask`` (uint8, 1 = a training target; only when the
encoder gives masks), each written under a temporary name and renamed when whole, then
``shard-NNNNN.json`` (its counts), which marks it complete. ``index.json``, written last, lists them all
and makes the folder complete. The token stream is the shards in corpus order, whatever the number of
processes that wrote them: a process claims a shard with a lock on its lock file, skips those others
hold, then waits for them; an interrupted preparation keeps its complete shards."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from config.job_config import Training, Validation
from trainer.data.corpus import (
    BATCH_RECORDS,
    Corpus,
    Piece,
    RecordBatch,
    corpus_identity,
    corpus_pieces,
    hub_batches,
    is_hub,
    piece_batches,
    pin_revision,
)
from trainer.data.tokenizer import Tokenizer, limit_encode_threads
from trainer.folders import write_whole

logger = logging.getLogger(__name__)

# Bump when the pieces, the encoding or the files change: no stale folder is reused.
FORMAT_VERSION = 1
HUB_SHARD_DOCUMENTS = 128 * BATCH_RECORDS  # a multiple: hub batches never straddle two shards
INDEX_FILE = "index.json"
_OPEN_SHARDS = 64  # memory maps kept open (each holds a file descriptor)


class DocumentEncoder(Protocol):
    fingerprint: str  # identifies the tokenizer and the format (and template) for the cache key
    field: str  # the record field it reads
    vocab_size: int  # ids are below it: it picks the shards' dtype and bounds the largest id

    def encode_batch(self, values: list[Any], where: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each value's token ids and per-token loss mask (None: every token is a target); a bad value
        raises a one-line ValueError naming its ``where``."""
        ...


class TextEncoder:
    """Each text as ``[bos] + ids + [eos]``, every token a target."""

    def __init__(self, tokenizer: Tokenizer, field: str = "text") -> None:
        self.tokenizer = tokenizer
        self.field = field
        self.vocab_size = tokenizer.vocab_size
        self.fingerprint = f"text:{tokenizer.fingerprint}"

    def encode_batch(self, values: list[Any], where: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        documents = []
        for ids in self.tokenizer.encode_batch(values):
            framed = np.empty(len(ids) + 2, dtype=np.int64)
            framed[0], framed[1:-1], framed[-1] = self.tokenizer.bos_id, ids, self.tokenizer.eos_id
            documents.append((framed, None))
        return documents


def encoder_for(section: Training | Validation, training: Training, tokenizer: Tokenizer) -> DocumentEncoder:
    """The encoder of a section's corpus in the run's data format."""
    if training.dataset_format == "chat":
        from trainer.data.chat import ChatEncoder  # jinja2 and the template: only for chat data

        return ChatEncoder(tokenizer.path)
    return TextEncoder(tokenizer, section.dataset_text_field)


def token_folder(corpus: Corpus, encoder: DocumentEncoder, cache_dir: str) -> str:
    """The shard folder of a corpus (its hub commit pinned) and an encoder."""
    key = json.dumps(
        {"version": FORMAT_VERSION, "corpus": corpus_identity(corpus), "encoder": encoder.fingerprint}, sort_keys=True
    )
    return os.path.join(cache_dir, f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:20]}")


def prepare_tokens(corpus: Corpus, encoder: DocumentEncoder, cache_dir: str, *, workers: int) -> ShardedTokens:
    """``corpus``'s token shards, made where missing by ``workers`` processes (0: one per core)."""
    corpus = pin_revision(corpus)  # one question to the hub, for both the key and the records
    folder = token_folder(corpus, encoder, cache_dir)
    if not os.path.exists(os.path.join(folder, INDEX_FILE)):
        os.makedirs(folder, exist_ok=True)
        processes = workers or len(os.sched_getaffinity(0))
        if is_hub(corpus.dataset):
            _prepare_stream(corpus, encoder, folder, processes)
        else:
            _prepare_pieces(corpus_pieces(corpus), encoder, folder, processes)
        with _locked(os.path.join(folder, INDEX_FILE + ".lock")):
            if not os.path.exists(os.path.join(folder, INDEX_FILE)):  # else written by another process
                _write_index(folder, corpus, encoder)
    return ShardedTokens(folder)


def _shard_path(folder: str, index: int, suffix: str) -> str:
    return os.path.join(folder, f"shard-{index:05d}.{suffix}")


def _complete(folder: str, index: int) -> bool:
    return os.path.exists(_shard_path(folder, index, "json"))


@contextlib.contextmanager
def _locked(path: str, *, wait: bool = True) -> Iterator[bool]:
    """Holds a POSIX lock on ``path`` (created, never deleted: a lock on a replaced inode excludes no
    one); without ``wait``, yields False at once when another process holds it."""
    with open(path, "a") as lock_file:
        try:
            fcntl.lockf(lock_file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            yield False
            return
        yield True  # closing the file releases the lock


def _prepare_pieces(pieces: list[Piece], encoder: DocumentEncoder, folder: str, processes: int) -> None:
    """Shards of ``pieces``: each claimed by one process; those held elsewhere waited for, and made here
    when their holder dies."""
    pending = [index for index in range(len(pieces)) if not _complete(folder, index)]
    text = isinstance(encoder, TextEncoder)
    while pending:
        tasks = [(folder, index, pieces[index], text) for index in pending]
        if min(processes, len(tasks)) <= 1:
            held = [index for index, built in map(_build_claimed_piece, tasks, [encoder] * len(tasks)) if not built]
        else:
            with _pool(min(processes, len(tasks)), encoder) as pool:
                done = concurrent.futures.as_completed([pool.submit(_build_claimed_piece, task) for task in tasks])
                held = [index for index, built in (future.result() for future in done) if not built]
        for index in held:
            with _locked(_shard_path(folder, index, "lock")):
                pass  # its holder finished, or died
        pending = sorted(index for index in held if not _complete(folder, index))


def _pool(processes: int, encoder: DocumentEncoder) -> ProcessPoolExecutor:
    # Started by a fork server: the caller runs threads (torch, gloo) that a fork would copy mid-step.
    # An executor, not multiprocessing's Pool: a worker that dies (killed, out of memory) fails the
    # preparation instead of hanging it; a new one resumes.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return ProcessPoolExecutor(processes, mp_context=context, initializer=_start_worker, initargs=(encoder,))


_worker_encoder: DocumentEncoder | None = None


def _start_worker(encoder: DocumentEncoder) -> None:
    global _worker_encoder
    limit_encode_threads(1)  # the pool's processes are the parallelism
    _worker_encoder = encoder


def _build_claimed_piece(
    task: tuple[str, int, Piece, bool], encoder: DocumentEncoder | None = None
) -> tuple[int, bool]:
    """Builds a shard unless another process holds it: (its index, whether it is complete or was built)."""
    folder, index, piece, text = task
    encoder = encoder or _worker_encoder
    with _locked(_shard_path(folder, index, "lock"), wait=False) as claimed:
        if not claimed:
            return index, False
        if not _complete(folder, index):
            with _ShardWriter(folder, index, encoder.vocab_size) as writer:
                for batch in piece_batches(piece, encoder.field, text=text):
                    writer.add(encoder.encode_batch(batch.values, batch.where), batch)
    return index, True


def _prepare_stream(corpus: Corpus, encoder: DocumentEncoder, folder: str, processes: int) -> None:
    """A hub dataset: one process reads the stream in order (the others wait for it), its batches
    encoded by the pool; a shard every HUB_SHARD_DOCUMENTS records; complete shards' records skipped."""
    with _locked(os.path.join(folder, "stream.lock")):
        if os.path.exists(os.path.join(folder, INDEX_FILE)):
            return
        done = 0
        while _complete(folder, done):
            done += 1
        batches = hub_batches(corpus, encoder.field, text=isinstance(encoder, TextEncoder))
        for _ in range(done * (HUB_SHARD_DOCUMENTS // BATCH_RECORDS)):
            if next(batches, None) is None:
                return  # the stream ended in the last complete shard
        if processes <= 1:
            encoded = ((encoder.encode_batch(b.values, b.where), b) for b in batches)
            _write_stream(encoded, folder, done, encoder.vocab_size)
            return
        with _pool(processes, encoder) as pool:
            _write_stream(_encoded_in_order(pool, batches, 2 * processes), folder, done, encoder.vocab_size)


def _encoded_in_order(
    pool: ProcessPoolExecutor, batches: Iterator[RecordBatch], in_flight: int
) -> Iterator[tuple[list[tuple[np.ndarray, np.ndarray | None]], RecordBatch]]:
    # At most ``in_flight`` batches wait: the reader never runs ahead of the encoders (Executor.map would).
    waiting: collections.deque[tuple[concurrent.futures.Future, RecordBatch]] = collections.deque()
    for batch in batches:
        waiting.append((pool.submit(_encode_in_worker, batch.values, batch.where), batch))
        if len(waiting) >= in_flight:
            result, done = waiting.popleft()
            yield result.result(), done
    while waiting:
        result, done = waiting.popleft()
        yield result.result(), done


def _encode_in_worker(values: list[Any], where: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
    return _worker_encoder.encode_batch(values, where)


def _write_stream(encoded: Iterator[tuple[list, RecordBatch]], folder: str, first: int, vocab_size: int) -> None:
    writer: _ShardWriter | None = None
    index = first
    for documents, batch in encoded:
        if writer is None:
            writer = _ShardWriter(folder, index, vocab_size)
        writer.add(documents, batch)
        if writer.documents == HUB_SHARD_DOCUMENTS:
            writer.finish()
            writer, index = None, index + 1
    if writer is not None:
        writer.finish()


class _ShardWriter:
    """Appends encoded documents to a shard's temporary files; ``finish`` renames them whole."""

    def __init__(self, folder: str, index: int, vocab_size: int) -> None:
        self.folder, self.index, self.vocab_size = folder, index, vocab_size
        self.dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
        self.tokens = self.documents = self.bytes = 0
        self.largest = -1
        self._files: dict[str, Any] = {suffix: open(self._partial(suffix), "wb") for suffix in ("tokens", "docs")}

    def _partial(self, suffix: str) -> str:
        return f"{_shard_path(self.folder, self.index, suffix)}.{os.getpid()}.tmp"

    def add(self, documents: list[tuple[np.ndarray, np.ndarray | None]], batch: RecordBatch) -> None:
        if not documents:
            return
        lengths = np.array([len(ids) for ids, _ in documents], dtype=np.int64)
        ids = np.concatenate([ids for ids, _ in documents])
        largest = int(ids.max()) if len(ids) else -1
        if largest >= self.vocab_size:  # checked here: reading never needs a pass over the tokens
            document = int(np.searchsorted(np.cumsum(lengths), int(ids.argmax()), side="right"))
            raise ValueError(f"{batch.where[document]}: encoded to id {largest}, past the {self.vocab_size} ids")
        self.largest = max(self.largest, largest)
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self._files["docs"].write(starts.astype(np.int64).tobytes())
        self._files["tokens"].write(ids.astype(self.dtype).tobytes())
        masks = [mask for _, mask in documents]
        if "mask" not in self._files and any(mask is not None for mask in masks):
            self._files["mask"] = open(self._partial("mask"), "wb")
            self._write_ones(self.tokens)  # the documents before the first mask: every token a target
        if "mask" in self._files:
            full = [np.ones(len(ids), np.uint8) if mask is None else mask for (ids, _), mask in zip(documents, masks)]
            self._files["mask"].write(np.concatenate(full).astype(np.uint8).tobytes())
        self.tokens += len(ids)
        self.documents += len(documents)
        self.bytes += batch.size

    def _write_ones(self, count: int) -> None:
        block = np.ones(min(count, 2**20), np.uint8)
        for start in range(0, count, 2**20):
            self._files["mask"].write(block[: count - start].tobytes())

    def finish(self) -> None:
        for suffix, file in self._files.items():
            file.close()
            os.replace(self._partial(suffix), _shard_path(self.folder, self.index, suffix))
        counts = {
            "tokens": self.tokens,
            "documents": self.documents,
            "bytes": self.bytes,
            "dtype": np.dtype(self.dtype).name,
            "masked": "mask" in self._files,
            "largest_id": self.largest,
        }
        write_whole(
            _shard_path(self.folder, self.index, "json"), lambda path: Path(path).write_text(json.dumps(counts))
        )

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, error_type: type | None, *_: Any) -> None:
        if error_type is None:
            self.finish()
            return
        for suffix, file in self._files.items():
            file.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._partial(suffix))


def _write_index(folder: str, corpus: Corpus, encoder: DocumentEncoder) -> None:
    shards = []
    while _complete(folder, len(shards)):
        shards.append(json.loads(Path(_shard_path(folder, len(shards), "json")).read_text()))
    index = {
        "version": FORMAT_VERSION,
        "corpus": corpus.dataset,
        "encoder": encoder.fingerprint,
        "tokens": sum(shard["tokens"] for shard in shards),
        "documents": sum(shard["documents"] for shard in shards),
        "shards": shards,
    }
    write_whole(os.path.join(folder, INDEX_FILE), lambda path: Path(path).write_text(json.dumps(index, indent=1)))


class ShardedTokens:
    """A prepared folder's token stream: the shards memory-mapped on first use, a small index in memory."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        try:
            index = json.loads(Path(folder, INDEX_FILE).read_text())
            self._shards: list[dict[str, Any]] = index["shards"]
            for number, shard in enumerate(self._shards):
                _check_shard_files(folder, number, shard)
        except (OSError, ValueError, KeyError, TypeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise ValueError(
                f"token shard folder {folder} is incomplete or damaged ({reason}); delete it and it is rebuilt"
            ) from None
        self._starts = np.cumsum([0, *(shard["tokens"] for shard in self._shards)], dtype=np.int64)
        self.num_tokens = int(self._starts[-1])
        self.num_documents = int(index["documents"])
        self.num_bytes = sum(shard["bytes"] for shard in self._shards)
        self.has_loss_mask = any(shard["masked"] for shard in self._shards)
        self._dtype = np.dtype(self._shards[0]["dtype"] if self._shards else np.uint16)
        self._maps: collections.OrderedDict[tuple[int, str], np.ndarray] = collections.OrderedDict()

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (a view when they lie in one shard)."""
        return self._gather(start, stop, lambda number, begin, end: self._map(number, "tokens")[begin:end])

    def loss_mask(self, start: int, stop: int) -> np.ndarray | None:
        if not self.has_loss_mask:
            return None
        return self._gather(start, stop, self._mask).astype(bool)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Sorted global offsets of the documents that begin in ``[start, stop)``."""
        found = [np.zeros(0, np.int64)]
        for number, begin, end in self._spans(start, stop):
            offsets = self._map(number, "docs")
            low, high = np.searchsorted(offsets, [begin, end])
            found.append(offsets[low:high] + self._starts[number])
        return np.concatenate(found)

    def _mask(self, number: int, begin: int, end: int) -> np.ndarray:
        if self._shards[number]["masked"]:
            return self._map(number, "mask")[begin:end]
        return np.ones(end - begin, np.uint8)

    def _spans(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(shard, start, stop inside it) of each shard that ``[start, stop)`` covers."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside the stream's {self.num_tokens}")
        number = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._starts[number + 1]))
            if end > start:
                yield number, start - int(self._starts[number]), end - int(self._starts[number])
            start, number = end, number + 1

    def _gather(self, start: int, stop: int, part: Callable[[int, int, int], np.ndarray]) -> np.ndarray:
        parts = [part(*span) for span in self._spans(start, stop)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, self._dtype)

    def _map(self, number: int, suffix: str) -> np.ndarray:
        key = (number, suffix)
        if key in self._maps:
            self._maps.move_to_end(key)
            return self._maps[key]
        shard = self._shards[number]
        dtype, length = {"tokens": (shard["dtype"], shard["tokens"]), "docs": (np.int64, shard["documents"])}.get(
            suffix, (np.uint8, shard["tokens"])
        )
        path = _shard_path(self.folder, number, suffix)
        array = np.memmap(path, dtype=dtype, mode="r", shape=(length,)) if length else np.zeros(0, dtype)
        self._maps[key] = array
        if len(self._maps) > _OPEN_SHARDS:
            self._maps.popitem(last=False)
        return array

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps do not cross to a data-loading worker: it maps the files again.
        return {**self.__dict__, "_maps": collections.OrderedDict()}


def _check_shard_files(folder: str, number: int, shard: dict[str, Any]) -> None:
    itemsize = np.dtype(shard["dtype"]).itemsize
    expected = {"tokens": shard["tokens"] * itemsize, "docs": shard["documents"] * 8}
    if shard["masked"]:
        expected["mask"] = shard["tokens"]
    for suffix, size in expected.items():
        path = _shard_path(folder, number, suffix)
        if not os.path.isfile(path):
            raise ValueError(f"{os.path.basename(path)} is missing")
        if os.path.getsize(path) != size:
            raise ValueError(f"{os.path.basename(path)} holds {os.path.getsize(path)} bytes, not {size}")
