"""Text corpora: the default one (the running interpreter's own documentation, so training
works on any machine without downloads), local ``.txt``/``.jsonl`` files and folders, and the
file cache that tokenizers and token streams are built into once."""

from __future__ import annotations

import ast
import fcntl
import functools
import importlib
import json
import os
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEFAULT_DATASET = "python_docs"
CORPUS_SUFFIXES = (".txt", ".jsonl")

# Folders of the standard library that hold tests, test data or third-party code.
_SKIPPED_STDLIB_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
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


def corpus_identity(dataset: str) -> dict[str, Any]:
    """What the corpus content depends on, cheap to compute (no reading)."""
    if dataset == DEFAULT_DATASET:
        return {"name": dataset, "python": sys.version, "stdlib": sysconfig.get_path("stdlib")}
    files = local_corpus_files(dataset)
    return {"files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def create_file_once(path: str, write: Callable[[str], None]) -> None:
    """Create ``path`` by calling ``write(tmp_path)`` unless it already exists.

    Safe for concurrent processes: an exclusive lock on ``path + ".lock"`` lets
    one process build the file while the others wait, and the file appears
    atomically (``os.replace``) so nobody reads a partial one.
    """
    if os.path.exists(path):
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # The lock file is never deleted: removing it would let two processes hold
    # locks on different inodes.
    with open(path + ".lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if os.path.exists(path):
            return  # built by another process while we waited
        fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp_path)
            os.chmod(tmp_path, 0o644)  # mkstemp creates owner-only files
            os.replace(tmp_path, path)
        finally:
            if os.path.exists(tmp_path):
                os.unlink(tmp_path)
