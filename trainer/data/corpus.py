"""Text corpora: the default one (the interpreter's own documentation: no download needed), local
files, Hugging Face hub datasets; and the file cache tokenizers and token streams are built into."""

from __future__ import annotations

import ast
import codecs
import dataclasses
import fcntl
import functools
import importlib
import json
import logging
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from config.errors import first_few, first_line, typed_first_line
from config.job_config import Training, Validation
from trainer.folders import write_whole

logger = logging.getLogger(__name__)

DEFAULT_DATASET = "python_docs"
# Formats read through `datasets`, by its builder's name (it decompresses .gz, as C4's shards are kept).
DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".json.gz": "json", ".jsonl.gz": "json"}
CORPUS_SUFFIXES = (".txt", ".jsonl", *DATASETS_BUILDERS)
_SUFFIX_NAMES = ", ".join(CORPUS_SUFFIXES)
# Files `Dataset.save_to_disk` writes next to its .arrow shards: metadata, not records.
_SAVE_TO_DISK_METADATA = frozenset({"dataset_info.json", "state.json", "dataset_dict.json"})
# torchtitan's dataset names; 'c4_test' is a folder of torchtitan's repository, found from the working folder.
TORCHTITAN_DATASETS = {
    "c4": ("allenai/c4", "en", "train"),
    "c4_validation": ("allenai/c4", "en", "validation"),
    "c4_test": ("tests/assets/c4_test", "", "train"),
}
_HUB_TIMEOUT_S = 10
# Each piece of a corpus becomes one token shard: .jsonl files cut at newlines into pieces of about
# PIECE_BYTES, consecutive .txt files grouped up to it; a corpus under 64 pieces of that size is cut
# finer (down to MIN_PIECE_BYTES), so that every preparing process has work until the end.
PIECE_BYTES = 64 * 2**20
MIN_PIECE_BYTES = 2**20
_PIECES_AT_LEAST = 64
# Records are read and encoded in batches of about this many bytes or this many records: memory stays
# bounded whatever a piece's size.
BATCH_BYTES = 2**20
BATCH_RECORDS = 256

# Folders of the standard library that hold tests, test data or third-party code.
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def default_corpus_texts() -> Iterator[str]:
    """The interpreter's help topics by name, then each standard-library module's docstrings in
    source order (parsed with ``ast``, never imported: some imports have side effects)."""
    return iter(_default_corpus_documents())


@functools.cache
def _default_corpus_documents() -> tuple[str, ...]:
    # Parsing takes seconds, and the default tokenizer and the token stream both need the few MB.
    try:
        topics: dict[str, str] = importlib.import_module("pydoc_data.topics").topics
    except ImportError:  # some distributions package pydoc_data separately
        topics = {}
    stdlib = _stdlib_docstrings(Path(sysconfig.get_path("stdlib")))
    return (*(topics[name] for name in sorted(topics)), *stdlib)


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


@dataclass(frozen=True)
class Corpus:
    """Where a run's documents come from: ``dataset`` is ``"python_docs"``, local paths (comma-separated)
    or a Hugging Face hub dataset; ``config_name`` and ``split`` choose a hub dataset's part."""

    dataset: str
    config_name: str = ""
    split: str = "train"
    text_field: str = "text"
    revision: str = ""  # a hub dataset's commit, once pin_revision asked the hub for it


def corpus_of(section: Training | Validation) -> Corpus:
    """The corpus of a section's dataset fields, torchtitan's dataset names mapped."""
    corpus = Corpus(section.dataset, section.dataset_config, section.dataset_split, section.dataset_text_field)
    if corpus.dataset in TORCHTITAN_DATASETS:
        name, config_name, split = TORCHTITAN_DATASETS[corpus.dataset]
        corpus = dataclasses.replace(corpus, dataset=name, config_name=config_name, split=split)
    return corpus


def is_hub(dataset: str) -> bool:
    """Whether ``dataset`` names a hub dataset (the default corpus and local files are read whole)."""
    return dataset != DEFAULT_DATASET and not is_local(dataset)


def is_local(dataset: str) -> bool:
    """Whether ``dataset`` names local files (existing or meant to be)."""
    if "," in dataset or dataset.count("/") > 1:  # hub names are 'name' or 'owner/name'
        return True
    path = Path(dataset).expanduser()
    return path.exists() or corpus_suffix(path) in CORPUS_SUFFIXES or dataset.startswith(("/", ".", "~"))


def corpus_suffix(path: Path) -> str:
    """The suffix that names a corpus file's format: ``.gz`` with the one before it."""
    return "".join(path.suffixes[-2:]) if path.suffix == ".gz" else path.suffix


def local_corpus_texts(path: str, text_field: str = "text") -> Iterator[str]:
    """Documents of a local corpus: one per ``.txt`` file, ``.jsonl`` line or ``datasets`` record."""
    for piece in corpus_pieces(Corpus(path, text_field=text_field)):
        for batch in piece_batches(piece, text_field, text=True):
            yield from batch.values


def local_corpus_files(path: str) -> list[Path]:
    """The files of a file, folder or comma-separated list of them; of one format."""
    files = [file for part in path.split(",") if part for file in _corpus_files(part)]
    if not files:
        raise ValueError(f"dataset {path!r} names no files")
    by_kind: dict[str, list[Path]] = {}
    for file in files:
        by_kind.setdefault(DATASETS_BUILDERS.get(corpus_suffix(file), "text"), []).append(file)
    if len(by_kind) > 1:
        # The fewest first: a stray LICENSE.txt among Parquet shards, say.
        kinds = sorted(by_kind.items(), key=lambda item: (len(item[1]), item[0]))
        shown = "; ".join(
            f"{kind}: {len(group)} ({group[0]}{', ...' if len(group) > 1 else ''})" for kind, group in kinds
        )
        raise ValueError(f"dataset {path} mixes formats ({shown}); give files of one format")
    return files


def _corpus_files(path: str) -> list[Path]:
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"dataset path not found: {path}")
    if root.is_dir():
        files = sorted(
            p
            for p in _files_under(root)
            if corpus_suffix(p) in CORPUS_SUFFIXES and p.name not in _SAVE_TO_DISK_METADATA and p.is_file()
        )
        if not files:
            raise ValueError(f"dataset folder {path} contains no {_SUFFIX_NAMES} files")
        return files
    if corpus_suffix(root) not in CORPUS_SUFFIXES:
        raise ValueError(f"dataset file {path} does not end in one of {_SUFFIX_NAMES}")
    return [root]


def _files_under(root: Path) -> Iterator[Path]:
    """Every file under ``root``, through symlinked folders, each real folder once, none holding ``root``;
    hidden ones (.git) left out with a warning: their copies would train twice."""
    real_root = os.path.realpath(root)
    seen: set[str] = set()
    hidden: list[str] = []
    for directory, subdirectories, file_names in os.walk(root, onerror=_refuse_unreadable, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen or (directory != str(root) and os.path.commonpath([real, real_root]) == real):
            subdirectories[:] = []
            continue
        seen.add(real)
        hidden += [os.path.join(directory, name) for name in subdirectories if name.startswith(".")]
        hidden += [
            os.path.join(directory, name)
            for name in file_names
            if name.startswith(".") and corpus_suffix(Path(name)) in CORPUS_SUFFIXES
        ]
        # Sorted: the first name to reach a folder reads it, whatever the listing order.
        subdirectories[:] = sorted(name for name in subdirectories if not name.startswith("."))
        yield from (Path(directory, name) for name in file_names if not name.startswith("."))
    if hidden:
        logger.warning("%s: hidden files and folders are not read: %s", root, first_few(sorted(hidden)))


def _refuse_unreadable(error: OSError) -> None:
    # os.walk passes over a folder it cannot list: its shards would be left out without a word.
    raise ValueError(f"{error.filename}: cannot read this folder of the corpus ({error.strerror})")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark (Windows editors) is no text
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


@dataclass(frozen=True)
class Piece:
    """The part of a corpus that becomes one token shard: the default corpus, consecutive .txt files (one
    document each), the bytes ``[start, stop)`` of a .jsonl file (whole lines), or one ``datasets`` file."""

    kind: str  # "python_docs", "txt", "jsonl" or "datasets"
    paths: tuple[str, ...] = ()
    start: int = 0
    stop: int = 0


class RecordBatch(NamedTuple):
    values: list[Any]  # the field's value of consecutive records
    where: list[str]  # each record's place, "path:line" or "source: record N", for one-line errors
    size: int  # bytes of the records' text


def corpus_pieces(corpus: Corpus) -> list[Piece]:
    """A local or the default corpus cut into pieces, in corpus order; the cuts depend on the files alone."""
    if corpus.dataset == DEFAULT_DATASET:
        return [Piece("python_docs")]
    pieces: list[Piece] = []
    texts: list[str] = []
    text_bytes = 0
    files = local_corpus_files(corpus.dataset)
    total = sum(path.stat().st_size for path in files)
    piece_bytes = min(PIECE_BYTES, max(total // _PIECES_AT_LEAST, MIN_PIECE_BYTES))
    for path in files:
        if path.suffix == ".txt":
            texts.append(str(path))
            text_bytes += path.stat().st_size
            if text_bytes < piece_bytes:
                continue
        if texts:
            pieces.append(Piece("txt", tuple(texts)))
            texts, text_bytes = [], 0
        if corpus_suffix(path) in DATASETS_BUILDERS:
            pieces.append(Piece("datasets", (str(path),)))
        elif path.suffix == ".jsonl":
            pieces += [Piece("jsonl", (str(path),), start, stop) for start, stop in _line_ranges(path, piece_bytes)]
    if texts:
        pieces.append(Piece("txt", tuple(texts)))
    return pieces


def _line_ranges(path: Path, piece_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``piece_bytes``, each ending after a newline (or at the end of the file)."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        for target in range(piece_bytes, size, piece_bytes):
            if target > cuts[-1]:  # else a line longer than a piece covers it
                f.seek(target - 1)  # a newline just before ``target`` cuts there
                f.readline()
                cuts.append(f.tell())
    cuts.append(size)
    return [(start, stop) for start, stop in zip(cuts, cuts[1:]) if stop > start]


def piece_batches(piece: Piece, field: str, *, text: bool) -> Iterator[RecordBatch]:
    """The values of ``field`` of a piece's records in batches of about BATCH_BYTES or BATCH_RECORDS;
    ``text``: each must be a string (a .txt file's content is one)."""
    if piece.kind == "python_docs":
        documents = enumerate(default_corpus_texts())
        records = ((doc, f"{DEFAULT_DATASET}: document {i}", len(doc.encode())) for i, doc in documents)
    elif piece.kind == "txt":
        records = ((_read_text(Path(path)), path, os.path.getsize(path)) for path in piece.paths)
    elif piece.kind == "jsonl":
        records = _jsonl_records(piece.paths[0], piece.start, piece.stop, field, text)
    else:
        path = piece.paths[0]
        builder = DATASETS_BUILDERS[corpus_suffix(Path(path))]
        streamed = _streamed_records(path, builder, data_files=[path], split="train")
        records = _record_values(streamed, path, field, text)
    return _batched(records, BATCH_BYTES)


def hub_batches(corpus: Corpus, field: str, *, text: bool) -> Iterator[RecordBatch]:
    """A hub dataset's records at its pinned commit, in order, in batches of BATCH_RECORDS exactly."""
    records = _streamed_records(
        corpus.dataset, corpus.dataset, name=corpus.config_name or None, split=corpus.split, revision=corpus.revision
    )
    return _batched(_record_values(records, f"{corpus.dataset} ({corpus.split})", field, text), None)


def _batched(records: Iterable[tuple[Any, str, int]], max_bytes: int | None) -> Iterator[RecordBatch]:
    batch = RecordBatch([], [], 0)
    for value, where, size in records:
        batch.values.append(value)
        batch.where.append(where)
        batch = batch._replace(size=batch.size + size)
        if len(batch.values) == BATCH_RECORDS or (max_bytes is not None and batch.size >= max_bytes):
            yield batch
            batch = RecordBatch([], [], 0)
    if batch.values:
        yield batch


def _jsonl_records(path: str, start: int, stop: int, field: str, text: bool) -> Iterator[tuple[Any, str, int]]:
    # Line numbers are counted from the file's start: a later piece names its lines by byte offset.
    line_number = 1 if start == 0 else 0
    offset = start
    for line in _lines(path, start, stop):
        line_start, offset = offset, offset + len(line) + 1
        where = f"{path}:{line_number}" if line_number else f"{path}: the line at byte {line_start}"
        line_number += bool(line_number)
        if line_start == 0 and line.startswith(codecs.BOM_UTF8):  # Windows editors begin files with one
            line = line[len(codecs.BOM_UTF8) :]
        try:
            decoded = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {line_start + error.start})") from None
        if not decoded.strip():
            continue
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: invalid JSON ({error.msg})") from None
        value = record.get(field) if isinstance(record, dict) else None
        if value is None or (text and not isinstance(value, str)):
            raise ValueError(f"{where}: expected an object with a {'string ' if text else ''}{field!r} field")
        yield value, where, len(line)


def _lines(path: str, start: int, stop: int) -> Iterator[bytes]:
    """The lines of bytes ``[start, stop)`` without their newlines, read a block at a time."""
    with open(path, "rb") as f:
        f.seek(start)
        remaining = stop - start
        partial: list[bytes] = []  # a line's blocks so far: a long line is joined once
        while remaining > 0 and (block := f.read(min(BATCH_BYTES, remaining))):
            remaining -= len(block)
            if b"\n" not in block:
                partial.append(block)
                continue
            lines = b"".join([*partial, block]).split(b"\n")
            partial = [lines.pop()]
            yield from lines
        if any(partial):
            yield b"".join(partial)


def _record_values(
    records: Iterable[dict[str, Any]], source: str, field: str, text: bool
) -> Iterator[tuple[Any, str, int]]:
    for index, record in enumerate(records):
        value = record.get(field)
        if field in record and text and not isinstance(value, str):
            held = "null" if value is None else f"a {type(value).__name__}"
            raise ValueError(f"{source}: record {index}'s field {field!r} is {held}, not text")
        if value is None:
            fields = ", ".join(record) or "none"
            raise ValueError(f"{source}: record {index} has no field {field!r} (its fields: {fields})")
        size = len(value.encode()) if isinstance(value, str) else len(json.dumps(value))
        yield value, f"{source}: record {index}", size


def _streamed_records(source: str, path: str, **options: Any) -> Iterator[dict[str, Any]]:
    """``datasets.load_dataset``'s records, streamed; its errors as one-line ValueErrors naming ``source``."""
    # Imported on use: it takes a second, and most runs read other corpora.
    import datasets
    import pyarrow

    # It logs the errors it raises too: they reach the user once, as the line raised below.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield from datasets.load_dataset(path, streaming=True, **options)
    except EOFError as error:  # gzip's word for a shard whose download or copy was cut short
        raise ValueError(f"{source}: a compressed file ends early, cut short ({typed_first_line(error)})") from None
    except (datasets.exceptions.DatasetsError, pyarrow.ArrowException, ValueError, OSError, KeyError) as error:
        raise ValueError(f"{source}: {typed_first_line(error)}") from None


def pin_revision(corpus: Corpus) -> Corpus:
    """``corpus`` with a hub dataset's current commit (one request, no retries: no network is said at once)."""
    if not is_hub(corpus.dataset) or corpus.revision:
        return corpus
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    name = corpus.dataset
    try:
        return dataclasses.replace(corpus, revision=HfApi().dataset_info(name, timeout=_HUB_TIMEOUT_S).sha or "")
    except RepositoryNotFoundError:
        raise ValueError(f"{name!r} is neither a local path nor a dataset on the Hugging Face hub") from None
    except Exception as error:  # the hub client raises its HTTP library's errors, which vary by version
        raise ValueError(
            f"{name!r} is not a local path, and the Hugging Face hub cannot be reached to look it up "
            f"({typed_first_line(error)})"
        ) from None


def corpus_texts(corpus: Corpus) -> Iterator[str]:
    if corpus.dataset == DEFAULT_DATASET:
        return default_corpus_texts()
    if is_local(corpus.dataset):
        return local_corpus_texts(corpus.dataset, corpus.text_field)
    batches = hub_batches(pin_revision(corpus), corpus.text_field, text=True)
    return (text for batch in batches for text in batch.values)


def corpus_identity(corpus: Corpus) -> dict[str, Any]:
    """What the corpus content depends on, cheap to compute (no reading; a hub dataset's commit)."""
    if corpus.dataset == DEFAULT_DATASET:
        return {"name": corpus.dataset, "python": sys.version, "stdlib": sysconfig.get_path("stdlib")}
    if is_local(corpus.dataset):
        files = local_corpus_files(corpus.dataset)
        stats = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        return {"files": stats, "text_field": corpus.text_field}
    return dataclasses.asdict(pin_revision(corpus))


def check_corpus(corpus: Corpus, field: str, *, text: bool) -> RecordBatch | None:
    """Cheap checks before launch; returns the first record's ``field`` (None for the slow default corpus)."""
    if corpus.dataset == DEFAULT_DATASET:
        return None
    if is_local(corpus.dataset):
        files = local_corpus_files(corpus.dataset)
        for path in files:
            _check_shard_schema(path, field, text)
        if all(path.stat().st_size == 0 for path in files):
            raise ValueError(f"{corpus.dataset}: empty, no text to train on")
        batches = piece_batches(corpus_pieces(corpus)[0], field, text=text)
    else:
        batches = hub_batches(pin_revision(corpus), field, text=text)
    first = next(batches, None)
    if first is None:
        raise ValueError(f"{corpus.dataset}: no documents")
    return RecordBatch(first.values[:1], first.where[:1], 0)


def _check_shard_schema(path: Path, text_field: str, text: bool) -> None:
    import pyarrow
    import pyarrow.parquet

    if path.suffix not in (".parquet", ".arrow"):
        return
    try:
        if path.suffix == ".parquet":
            schema = pyarrow.parquet.read_schema(path)
        else:
            with pyarrow.memory_map(str(path)) as source:
                schema = _arrow_schema(source)
    except (pyarrow.ArrowException, OSError) as error:
        raise ValueError(f"{path}: unreadable {path.suffix[1:]} file ({first_line(error)})") from None
    if text_field not in schema.names:
        raise ValueError(f"{path}: no field {text_field!r} (its fields: {', '.join(schema.names) or 'none'})")
    field_type = schema.field(text_field).type
    if text and not (pyarrow.types.is_string(field_type) or pyarrow.types.is_large_string(field_type)):
        raise ValueError(f"{path}: field {text_field!r} holds {field_type}, not text")


def _arrow_schema(source: Any) -> Any:
    import pyarrow

    # `datasets` writes Arrow's streaming format; other tools write its file format.
    try:
        return pyarrow.ipc.open_stream(source).schema
    except pyarrow.ArrowInvalid:
        source.seek(0)
        return pyarrow.ipc.open_file(source).schema


def create_file_once(path: str, write: Callable[[str], None]) -> None:
    """Creates ``path`` with ``write(partial path)`` unless it exists; concurrent processes wait for one."""
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # The lock file is never deleted: two processes could then hold locks on different inodes.
    with open(path + ".lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if not os.path.exists(path):  # else built by another process while we waited
            write_whole(path, write)
