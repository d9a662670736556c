"""What makes a checkpoint folder complete and intact: a save ends with rank 0 writing
``checkpoint_complete.json`` (every file's size and CRC-32), and only folders with it are loaded.
On load every rank verifies a share of the files. CRC-32 is the standard library's fastest
checksum (``bench/checksum.py``): it guards against corruption, not tampering."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from config.errors import typed_first_line
from trainer.folders import write_run_file

COMPLETE_MARKER = "checkpoint_complete.json"
STEP_FOLDER = re.compile(r"^step-(\d+)$")
_CHUNK = 8 * 2**20
_CHECKSUMS_FQN = "__tessera_file_checksums__"  # a write result that carries a rank's CRCs, not a tensor


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, truncated or corrupt. The message names it."""


def checkpoint_folders(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every step-N folder, newest first."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        if (match := STEP_FOLDER.match(name)) and os.path.isdir(os.path.join(folder, name)):
            found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found, reverse=True)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, newest first."""
    return [(step, path) for step, path in checkpoint_folders(folder) if is_complete(path)]


def file_crc32(path: str) -> str:
    """The CRC-32 of a file as 8 hex digits."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return f"{crc:08x}"


class _Crc32Stream:
    """A file being written that keeps the CRC-32 of the bytes written to it."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw
        self.crc = 0

    def write(self, data: Any) -> int:
        written = self.raw.write(data)
        self.crc = zlib.crc32(memoryview(data).cast("B")[:written], self.crc)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _ChecksummingFileSystem(FileSystem):
    """DCP's file system (``inner``), calling ``record(file name, crc)`` as each written file closes."""

    def __init__(self, record: Callable[[str, str], None], inner: FileSystem | None = None):
        self.record = record
        self.inner = inner or FileSystem()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with self.inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _Crc32Stream(raw)
            yield stream
        self.record(os.path.basename(path), f"{stream.crc:08x}")


class ChecksummedWriter(FileSystemWriter):
    """DCP's writer computing each file's CRC-32 while writing; the coordinator's ``checksums`` has all."""

    def __init__(self, path: str | os.PathLike, file_system: FileSystem | None = None, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem(self._record, file_system)
        self.checksums: dict[str, str] = {}
        self._written: dict[str, str] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    def _record(self, name: str, crc: str) -> None:
        with self._lock:
            self._written[name] = crc

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        written.wait()
        with self._lock:
            crcs = dict(self._written)
        report = WriteResult(index=MetadataIndex(_CHECKSUMS_FQN), size_in_bytes=0, storage_data=crcs)
        future: Future[list[WriteResult]] = Future()
        future.set_result([*written.value(), report])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        kept = []
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn == _CHECKSUMS_FQN:
                    self.checksums.update(result.storage_data)
            kept.append([result for result in rank_results if result.index.fqn != _CHECKSUMS_FQN])
        super().finish(metadata, kept)


def write_marker(
    path: str, step: int, checksums: dict[str, str], launch: str = "", layout: dict[str, int] | None = None
) -> None:
    """Lists every file's size and CRC-32 (read back here where no writer gave one), the launch and
    the run's layout (``elastic.RunLayout``)."""
    files, crcs = {}, {}
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not name.startswith(COMPLETE_MARKER) and os.path.isfile(file):  # the marker, a left-over partial one
            files[name] = os.path.getsize(file)
            crcs[name] = checksums.get(name) or file_crc32(file)
    marker = {"step": step, "files": files, "crc32": crcs, "launch": launch}
    if layout is not None:
        marker["layout"] = layout
    write_run_file(os.path.join(path, COMPLETE_MARKER), json.dumps(marker, indent=1), sync=True)


def read_marker(path: str, require_marker: bool) -> dict[str, Any]:
    """The marker's content, {} for a DCP folder without one when ``require_marker`` is off."""
    marker = os.path.join(path, COMPLETE_MARKER)
    try:
        with open(marker) as f:
            content = json.load(f)
        if not isinstance(content["files"], dict) or not isinstance(content.get("crc32", {}), dict):
            raise ValueError("'files' and 'crc32' must be tables")
        return content
    except FileNotFoundError:
        if require_marker or not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})") from None
        return {"files": {}}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is unreadable: {e}") from None


def _share(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` verifies: the largest first, each to the rank with the fewest bytes so far."""
    load = [0] * world_size
    mine = []
    for name in sorted(sizes, key=lambda n: (-int(sizes[n]), n)):
        least = load.index(min(load))
        load[least] += int(sizes[name])
        if least == rank:
            mine.append(name)
    return sorted(mine)


def verify_files(path: str, require_marker: bool = True, rank: int = 0, world_size: int = 1) -> None:
    """Checks ``rank``'s share of the files against the marker; CheckpointError names a bad one."""
    marker = read_marker(path, require_marker)
    expected_crcs = marker.get("crc32", {})
    for name in _share(marker["files"], rank, world_size):
        file, size = os.path.join(path, name), marker["files"][name]
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing")
        try:
            if os.path.getsize(file) != size:
                raise CheckpointError(f"{file} is truncated or changed: {os.path.getsize(file)} bytes, expected {size}")
            if name in expected_crcs and (crc := file_crc32(file)) != expected_crcs[name]:
                raise CheckpointError(f"{file} is corrupt: its CRC-32 is {crc}, the marker says {expected_crcs[name]}")
        except OSError as e:  # unreadable: every rank's verdict is gathered, none may leave early
            raise CheckpointError(f"{file}: {e.strerror}") from None


def read_metadata(path: str) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # an unpickling failure can be of any type
        raise CheckpointError(f"{os.path.join(path, '.metadata')} is corrupt: {typed_first_line(e)}") from None


def parts_of(metadata: Metadata) -> set[str]:
    """The top-level parts (model, optimizer, ...) of a checkpoint."""
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def model_shapes_of(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """The shape of every model tensor of a checkpoint, by name (``model.<fqn>``)."""
    return {
        key: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }
