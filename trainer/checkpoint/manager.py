"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``<dump_folder>/<checkpoint.folder>/step-N/``: every rank writes its shards, the
coordinator writes DCP's ``.metadata``, and rank 0 writes ``checkpoint_complete.json`` last,
listing every file with its size and its CRC-32. Only folders with that marker are ever loaded, so
a save cut short by a crash is never resumed from, and a file changed later (truncated, or a byte
changed in place) is detected by content and named.

Checksums: each rank computes the CRC-32 of its own shards while writing them (the bytes pass
through zlib.crc32 on their way to the file, in the thread that writes them: the background thread
of an async save), and the CRCs travel to the coordinator with DCP's write results; rank 0 reads
back only the small files it writes itself (``.metadata``, ``config.toml``) when it writes the
marker. No file is read again to save it. On load every rank verifies a share of the files
(balanced by size) and the verdicts are gathered, so verifying takes the time of reading
1/world_size of the checkpoint. CRC-32 (zlib) because it is the fastest checksum in the standard
library (1-4 GB/s on one core of this machine, 1.3-2.3x sha1 and sha256, 3-4.5x blake2b; nothing
faster is installed), releases the GIL on large buffers, and catches every error burst up to 32
bits and all but 2^-32 of other changes: it guards against storage corruption, not tampering.
``python bench/checksum.py`` measures it.

Model and optimizer state are saved under the model's own parameter names as DTensors, so DCP
reshards them when the next run uses another layout (data, tensor or pipeline parallel, FSDP2 or
SimpleFSDP). The dataloader state is one global stream position, valid for any number of
data-parallel ranks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import json
import logging
import operator
import os
import re
import shutil
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from config.errors import ConfigError, typed_first_line, user_input
from config.job_config import CHECKPOINT_PARTS, RESOLVED_CONFIG_FILE, Checkpoint
from models.sizes import is_hf_folder
from parallelisms.device import pinned_memory_available
from parallelisms.float8 import plain_tensor
from trainer.checkpoint.hf import ExportAssets, export_hf, load_hf_weights, weights_only_problem
from trainer.distributed import is_first_attempt, launch_id
from trainer.metrics import free_path
from trainer.optim import optimizers_holding_state

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint_complete.json"
# The options whose values a loaded part brings back: the optimizer's settings, and the LR schedule
# (its peak and its shape, which training.steps sets unless lr_scheduler.total_steps does).
_RESTORED_OPTIONS = {
    "optimizer": ("optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay"),
    "lr_scheduler": (
        "optimizer.lr",
        "lr_scheduler.warmup_steps",
        "lr_scheduler.decay_type",
        "lr_scheduler.decay_ratio",
        "lr_scheduler.min_lr_factor",
        "lr_scheduler.total_steps",
        "training.steps",
    ),
}
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
# What a save writes in its step folder: DCP's shards and metadata, the run's config, the marker.
_SAVE_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?|config\.toml|checkpoint_complete\.json(\.tmp)?")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, truncated or corrupt. The message names it."""


# ---------------------------------------------------------------------------------------------
# What is saved


def whole_model(model_parts: list[nn.Module]) -> nn.Module:
    """One module over all of this rank's model parts, with the parameters under their names in
    the full model. Pipeline stages are copies of the full model with blocks deleted, so the
    union of their children (block dictionaries merged) names every parameter as the full model
    does, and a checkpoint written at one pipeline layout loads at another."""
    if len(model_parts) == 1:
        return model_parts[0]
    root = nn.Module()
    for part in model_parts:
        if next(part.parameters(recurse=False), None) is not None:
            raise ValueError(f"{type(part).__name__} has parameters outside its sub-modules")
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict):
                if name not in root._modules:
                    root.add_module(name, nn.ModuleDict())
                root._modules[name].update(child)
            else:
                root.add_module(name, child)
    return root


def _plain_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    # Float8-gathered weights and their optimizer state are saved as the tensors they wrap (sharing
    # their storage, so loads land in them too): checkpoints of float8 runs load without float8.
    return {key: plain_tensor(value) if isinstance(value, torch.Tensor) else value for key, value in state_dict.items()}


class ModelState(Stateful):
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return _plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter name (not by position), so it reshards with the model."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizers = optimizers_holding_state(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return _plain_tensors(get_optimizer_state_dict(self.model, self.optimizers, options=self._OPTIONS))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers, state_dict, options=self._OPTIONS)


class TrainState(Stateful):
    """The step counter and random-number generators' state (the same on every rank)."""

    def __init__(self, get_step: Callable[[], int], set_step: Callable[[int], None], device: torch.device):
        self.get_step = get_step
        self.set_step = set_step
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.get_step(), "cpu_rng": torch.get_rng_state()}
        if self.device.type != "cpu":
            state["device_rng"] = torch.get_device_module(self.device).get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.set_step(int(state_dict["step"]))
        torch.set_rng_state(state_dict["cpu_rng"])
        if "device_rng" in state_dict:
            torch.get_device_module(self.device).set_rng_state(state_dict["device_rng"])


# ---------------------------------------------------------------------------------------------
# Folders on disk


def checkpoint_folders(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every step-N folder, newest first, complete or not."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = _STEP_FOLDER.match(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found, reverse=True)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def complete_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, newest first."""
    return [(step, path) for step, path in checkpoint_folders(folder) if is_complete(path)]


def check_resume(config: Checkpoint, folder: str) -> None:
    """ConfigError for a resume the options contradict: ``load_step`` with no such checkpoint in
    ``folder``; ``train_state`` excluded while ``folder`` holds checkpoints to resume from (the
    step count would start again at 1 and the run's saves replace them); and, unless
    ``load_only``, a step-N entry in ``folder`` that no save here left (``foreign_step_entry``),
    which a save of that step would write into and keep_latest_k then delete."""
    if not config.load_only and (foreign := foreign_step_entry(folder)):
        raise ConfigError(
            f"checkpoint.folder: {foreign}; a save of that step would write into it: move it away, or give "
            "another checkpoint.folder or job.dump_folder"
        )
    if config.load_step >= 0:
        complete_checkpoint_at(folder, config.load_step)
    if "train_state" in config.exclude_from_loading and (found := complete_checkpoints(folder)):
        raise ConfigError(
            f"checkpoint.exclude_from_loading: train_state, but {found[0][1]} is resumed from: its step count "
            "would start again at 1 and this run's saves replace its checkpoints; to start a new run from it, "
            "give it as checkpoint.initial_load_path with another checkpoint.folder or job.dump_folder"
        )


def foreign_step_entry(folder: str) -> str | None:
    """What is wrong with the first step-N entry of ``folder`` that no save here left, if any: a
    file, or a folder holding other files than a save writes, or another tool's complete DCP
    checkpoint (``.metadata`` without a marker or config.toml; torchtitan's has neither)."""
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not _STEP_FOLDER.match(name):
            continue
        if not os.path.isdir(path):
            return f"{path} is a file, where a save writes a folder"
        if is_complete(path):
            continue
        names = os.listdir(path)
        ours = all(_SAVE_FILE.fullmatch(n) and os.path.isfile(os.path.join(path, n)) for n in names)
        # A save writes its config.toml first and DCP's .metadata last.
        if not ours or (".metadata" in names and RESOLVED_CONFIG_FILE not in names):
            return f"{path} holds files no save of this trainer wrote (another tool's checkpoint, or yours)"
    return None


def check_seed_target(folder: str) -> None:
    """ConfigError when ``folder`` already holds a step-0 checkpoint (an earlier seed, of this
    model or another): ``checkpoint.create_seed_checkpoint`` would write over it."""
    path = os.path.join(folder, "step-0")
    if is_complete(path) or os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint: {path} already holds a checkpoint, which the seed would "
            "overwrite; move it aside or give another checkpoint.folder or job.dump_folder"
        )


def complete_checkpoint_at(folder: str, step: int) -> str:
    """The path of the complete checkpoint of ``step`` in ``folder`` (``checkpoint.load_step``);
    ConfigError naming that option when there is none."""
    paths = dict(complete_checkpoints(folder))
    if step not in paths:
        raise ConfigError(f"checkpoint.load_step: no complete checkpoint step-{step} in {folder}")
    return paths[step]


# ---------------------------------------------------------------------------------------------
# Checksums


_CHUNK = 8 * 2**20
_CHECKSUMS_FQN = "__tessera_file_checksums__"  # a write result that carries a rank's CRCs, not a tensor


def _crc_hex(crc: int) -> str:
    return f"{crc:08x}"


def file_crc32(path: str) -> str:
    """The CRC-32 of a file as 8 hex digits, read in 8 MiB chunks into one reused buffer."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
    return _crc_hex(crc)


class _Crc32Stream:
    """A file being written that keeps the CRC-32 of the bytes written to it. DCP uses write, tell,
    flush, fileno (for fsync) and close; anything else goes to the file."""

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
    """DCP's local file system, with every file written passing through a CRC-32 and the result
    handed to ``record(file name, crc)`` once the file is closed. ``inner`` opens the files."""

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
        self.record(os.path.basename(path), _crc_hex(stream.crc))


class ChecksummedWriter(FileSystemWriter):
    """DCP's FileSystemWriter that computes each file's CRC-32 as it writes it. Every rank's CRCs
    reach the coordinator with the write results; after the save, the coordinator's ``checksums``
    holds them all (file name -> 8 hex digits). ``file_system`` opens the files (tests use one whose
    disk fills up)."""

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


def write_marker(path: str, step: int, checksums: dict[str, str], launch: str = "") -> None:
    """Lists every file with its size and CRC-32: the writers' CRCs where they reported one, else
    (``.metadata``, ``config.toml``) read back here; and the launch that saved it."""
    files, crcs = {}, {}
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not name.startswith(COMPLETE_MARKER) and os.path.isfile(file):  # the marker, a left-over .tmp
            files[name] = os.path.getsize(file)
            crcs[name] = checksums.get(name) or file_crc32(file)
    tmp = os.path.join(path, COMPLETE_MARKER + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"step": step, "files": files, "crc32": crcs, "launch": launch}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, COMPLETE_MARKER))
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# Verification


def _read_marker(path: str, require_marker: bool) -> dict[str, Any]:
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
    """The files ``rank`` verifies: the largest first, each to the rank with the fewest bytes so
    far (the same split on every rank)."""
    load = [0] * world_size
    mine = []
    for name in sorted(sizes, key=lambda n: (-int(sizes[n]), n)):
        least = load.index(min(load))
        load[least] += int(sizes[name])
        if least == rank:
            mine.append(name)
    return sorted(mine)


def verify_files(path: str, require_marker: bool = True, rank: int = 0, world_size: int = 1) -> None:
    """Checks ``rank``'s share of a checkpoint's files against its marker: present, of the listed
    size and, when the marker has one (markers before CRCs have none), of the listed CRC-32.
    Raises CheckpointError naming the first bad file."""
    marker = _read_marker(path, require_marker)
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


def _saved_config(path: str) -> dict[str, Any]:
    """The options of the run that saved the checkpoint ``path`` (its config.toml); empty when it
    has none or it does not read (another tool's checkpoint, or damaged)."""
    try:
        with open(os.path.join(path, RESOLVED_CONFIG_FILE), "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _check_same_loader_workers(path: str, saved: dict[str, Any], own: dict[str, Any]) -> None:
    """The data position is each loader worker's: under another number of workers its state
    does not load (DCP names a missing key), which is the job's option, not a bad checkpoint."""
    before = saved.get("training", {}).get("dataloader_num_workers")
    now = own.get("training", {}).get("dataloader_num_workers")
    if before is not None and now is not None and before != now:
        raise ConfigError(
            f"training.dataloader_num_workers {now}: the data position in {path} was saved by {before}; keep "
            f"{before}, or start the data over with --checkpoint.exclude_from_loading dataloader"
        )


def _restored_option_changes(saved: dict[str, Any], own: dict[str, Any], parts: list[str]) -> list[str]:
    """The options this run sets (``own``) otherwise than the run that saved a checkpoint (its
    config.toml's, ``saved``), among those whose values the loaded ``parts`` bring back, each with
    the saved value."""
    if not saved:
        return []  # saved by another tool, or damaged: nothing to compare with
    changes = []
    for option in (option for part in parts for option in _RESTORED_OPTIONS.get(part, ())):
        section, key = option.split(".")
        if option == "training.steps" and own.get("lr_scheduler", {}).get("total_steps") is not None:
            continue  # the schedule's length is lr_scheduler.total_steps
        if (value := own.get(section, {}).get(key)) == (before := saved.get(section, {}).get(key)):
            continue
        if option == "training.steps":  # it counts for the steps run, not for the schedule
            changes.append(
                f"training.steps {value} (saved: {before}; the run goes to step {value}, its LR schedule "
                f"is the saved one of {before} steps, at its final rate after those)"
            )
        else:
            changes.append(f"{option} {value} (saved: {before})")
    return changes


def _read_metadata(path: str) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # an unpickling failure can be of any type
        raise CheckpointError(f"{os.path.join(path, '.metadata')} is corrupt: {typed_first_line(e)}") from None


def _parts_of(metadata: Metadata) -> set[str]:
    """The top-level parts (model, optimizer, ...) a checkpoint's metadata lists."""
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def _model_shapes_of(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    """The shape of every model tensor a checkpoint's metadata lists, by name (``model.<fqn>``)."""
    return {
        key: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and hasattr(entry, "size")
    }


def another_model(option: str, path: str, difference: str) -> str:
    """The line for a checkpoint at ``path`` (given by ``option``) whose model is not the job's."""
    return f"{option}: {path} holds another model than this job's: {difference}"


def saved_model_difference(path: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the model tensors of the DCP checkpoint at ``path`` differ from a whole model's
    (``shapes``: its state dict's names and shapes), as ``model_difference`` says it; read from
    the metadata alone, in one process."""
    try:
        saved = _model_shapes_of(_read_metadata(path))
    except CheckpointError as e:
        return str(e)
    wanted = {f"model.{key}": shape for key, shape in shapes.items()}
    return model_difference(
        saved,
        missing=[key for key in wanted if key not in saved],
        extra=[key for key in saved if key not in wanted],
        reshaped={key: shape for key, shape in wanted.items() if key in saved and saved[key] != shape},
    )


def model_difference(
    saved: dict[str, tuple[int, ...]], missing: list[str], extra: list[str], reshaped: dict[str, tuple[int, ...]]
) -> str | None:
    """How the model tensors a checkpoint holds (``saved``, names to shapes) differ from those a
    model loads: the names it lacks, the names the model has no place for, and the model's shape
    of those saved with another, in a few words each; None when they match."""
    differences = []
    if missing:
        differences.append(f"{len(missing)} tensors it lacks ({_first(missing)})")
    if extra:
        differences.append(f"{len(extra)} tensors the model has no place for ({_first(extra)})")
    if reshaped:
        key, shape = next(iter(reshaped.items()))
        differences.append(
            f"{len(reshaped)} of other shapes ({key.removeprefix('model.')}: {list(saved[key])} saved, "
            f"{list(shape)} in the model)"
        )
    return "; ".join(differences) or None


def _first(keys: list[str]) -> str:
    return ", ".join(key.removeprefix("model.") for key in keys[:2]) + (", ..." if len(keys) > 2 else "")


def verify_checkpoint(path: str, require_marker: bool = True) -> set[str]:
    """Checks every file of a complete checkpoint against its marker (sizes and CRC-32s) and reads
    its metadata; returns the top-level parts it holds (model, optimizer, ...). Raises
    CheckpointError naming the bad file. Without ``require_marker``, a DCP folder written elsewhere
    (no marker) is checked by its metadata alone."""
    verify_files(path, require_marker)
    return _parts_of(_read_metadata(path))


def _save_failed(path: str, error: BaseException) -> CheckpointError:
    """One line for a failed save, naming the folder, and its disk when that is full (torch's
    writer reports a full disk as a position it did not reach)."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = _FULL_DISK_BYTES
    disk = f" (its disk is full: {free} bytes free)" if free < _FULL_DISK_BYTES else ""
    return CheckpointError(f"saving {path} failed{_describe(error)}{disk}")


_FULL_DISK_BYTES = 2**20


def _describe(error: BaseException) -> str:
    """': Type: first line' of an error; for DCP's CheckpointException, of the lowest failing
    rank's error (' on rank R: ...')."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        return f" on rank {rank}: {typed_first_line(cause)}"
    return f": {typed_first_line(error)}"


@dataclass
class _Save:
    """A save in flight: its step, folder, completion and writer (which holds the CRCs)."""

    step: int
    path: str
    done: concurrent.futures.Future
    writer: FileSystemWriter


# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves (synchronously or in the background) and restores a run's state: the model parts,
    the optimizer, the LR scheduler, the dataloader and ``train_state`` (step and RNG).

    Only rank 0 touches folders as a whole (markers, deletion); at most one save is in flight, and
    the next save, a load or ``close`` waits for it; its collectives run in a group of their own
    with ``timeout_seconds`` (torch's default when None). ``storage_writer(step, path)`` makes the
    writer of each save (a ChecksummedWriter, whose CRCs go into the marker; the marker's writer
    computes them for files that another writer wrote).

    A save that fails (a full disk, a rank that died or hung past the collective timeout) raises
    CheckpointError naming its folder, which then has no marker and is never loaded.
    """

    def __init__(
        self,
        config: Checkpoint,
        dump_folder: str,
        resolved_config: str,
        *,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Stateful,
        dataloader: Stateful,
        train_state: TrainState,
        storage_writer: Callable[[int, str], FileSystemWriter] = lambda step, path: ChecksummedWriter(path),
        timeout_seconds: int | None = None,
    ):
        self.config = config
        self.folder = os.path.join(dump_folder, config.folder)
        self.model_parts = model_parts
        model = whole_model(model_parts)  # one view for the model and the optimizer state
        self.states: dict[str, Stateful] = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": lr_scheduler,
            "dataloader": dataloader,
            "train_state": train_state,
        }
        self.resolved_config = resolved_config
        self.storage_writer = storage_writer
        self.rank = dist.get_rank()
        # Background saves run collectives from another thread: a group of their own keeps them
        # from interleaving with training's collectives. Its timeout is the start-up one until
        # trainer.distributed.set_collective_timeout switches every group to the training one.
        timeout = datetime.timedelta(seconds=timeout_seconds) if timeout_seconds else None
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: _Save | None = None
        self._staging: concurrent.futures.Future | None = None
        self._purger = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-purge")
        self._stager = self._build_stager() if config.async_mode != "disabled" else None

    def _build_stager(self) -> DefaultStager:
        pinned = self.config.async_mode == "async_with_pinned_mem"
        if pinned and not pinned_memory_available():
            logger.info("checkpoint.async_mode=async_with_pinned_mem: no accelerator, staging in ordinary memory")
            pinned = False
        # The copy into the staging buffers runs in a thread too, overlapping the next forward and
        # backward; wait_for_staging() holds the optimizer update until it is done.
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=pinned
            )
        )

    # ------------------------------------------------------------------ saving

    def save(self, step: int, last_step: int) -> None:
        """After training step ``step``: saves every ``checkpoint.interval`` steps, at
        ``last_step`` and, with ``enable_first_step_checkpoint``, at step 1 (never with
        ``load_only``); otherwise completes a background save that has finished."""
        first = step == 1 and self.config.enable_first_step_checkpoint
        due = step % self.config.interval == 0 or step == last_step or first
        if self.config.enable and not self.config.load_only and due:
            self.write(step)
        else:
            self.poll()

    def write(self, step: int, parts: Iterable[str] = CHECKPOINT_PARTS) -> None:
        """Saves ``parts`` as step-``step``: written when it returns (sync), or copied and written
        in the background (async; call ``wait_for_staging`` before changing the saved tensors)."""
        self.wait()
        path = os.path.join(self.folder, f"step-{step}")
        state = {part: self.states[part] for part in parts}
        writer = self.storage_writer(step, path)
        try:
            if self.rank == 0:
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, RESOLVED_CONFIG_FILE), "w") as f:
                    f.write(self.resolved_config)
            if self._stager is None:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            else:
                response = dcp.async_save(
                    state, storage_writer=writer, process_group=self.group, async_stager=self._stager
                )
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise _save_failed(path, e) from None
        if self._stager is None:
            self._finish(step, path, writer)
            return
        assert isinstance(response, AsyncSaveResponse)  # given by the asynchronous stager
        self._staging = response.staging_completion
        self._pending = _Save(step, path, response.upload_completion, writer)

    def wait_for_staging(self) -> None:
        """Returns once the save in flight has copied the state: from then on the model and
        optimizer may change."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def poll(self) -> None:
        """Completes a finished background save (marker, purge) without waiting for one in flight."""
        if self._pending is not None and self._pending.done.done():
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight, if any, and completes it."""
        self.wait_for_staging()
        if self._pending is None:
            return
        save, self._pending = self._pending, None
        try:
            save.done.result()
        except (Exception, CheckpointException) as e:
            raise _save_failed(save.path, e) from None
        self._finish(save.step, save.path, save.writer)

    def _finish(self, step: int, path: str, writer: FileSystemWriter) -> None:
        if self.rank != 0:
            return
        try:
            write_marker(path, step, getattr(writer, "checksums", {}), launch_id())
        except OSError as e:
            raise CheckpointError(f"completing {path} failed: {typed_first_line(e)}") from None
        logger.info("checkpoint saved: %s", path)
        if self.config.keep_latest_k > 0:
            self._purger.submit(self._purge, self.config.keep_latest_k)

    def _purge(self, keep: int) -> None:
        for _, path in complete_checkpoints(self.folder)[keep:]:
            # The marker goes first: a deletion cut short leaves an incomplete folder, never a
            # complete-looking one with files missing.
            try:
                os.remove(os.path.join(path, COMPLETE_MARKER))
                shutil.rmtree(path)
            except OSError as e:  # in the purge's thread, which nothing waits on for an error
                logger.warning("deleting %s (keep_latest_k=%d) failed: %s", path, keep, typed_first_line(e))
                continue
            logger.info("checkpoint deleted (keep_latest_k=%d): %s", keep, path)

    # ------------------------------------------------------------------ loading

    def load_at_start(self) -> str | None:
        """Restores the newest complete checkpoint and returns its folder, or else loads
        ``checkpoint.initial_load_path``: its model weights (a DCP checkpoint folder or a Hugging
        Face folder; returns None) or, without ``initial_load_model_only``, every wanted part of
        a DCP checkpoint (returns its folder)."""
        if self.config.enable and (step := self.resume()) is not None:
            logger.info("resumed from step %d", step)
            if self.config.initial_load_path and is_first_attempt():  # a restart's own resume goes without saying
                logger.warning(
                    "checkpoint.initial_load_path %s is not loaded: a run resumes from its own checkpoints first "
                    "(step-%d); give another checkpoint.folder or job.dump_folder to start from it",
                    self.config.initial_load_path,
                    step,
                )
            return os.path.join(self.folder, f"step-{step}")
        path = self.config.initial_load_path
        if not path:
            return None
        if not os.path.isdir(path):
            raise ConfigError(f"checkpoint.initial_load_path: {path} is not a folder")
        if problem := weights_only_problem(self.config):
            raise ConfigError(problem)
        if is_hf_folder(path):
            with user_input("checkpoint.initial_load_path"):
                load_hf_weights(self.model_parts, path)
        else:
            whole = not self.config.initial_load_model_only
            parts = self._wanted_parts(path) if whole else ["model"]
            try:
                self._load_checked(path, parts, require_marker=False, option="checkpoint.initial_load_path")
            except CheckpointError as e:  # the same files again at a restart
                raise ConfigError(f"checkpoint.initial_load_path: {e}") from None
            if whole:
                logger.info("initial state loaded from %s", path)
                return path
        logger.info("initial weights loaded from %s", path)
        return None

    def write_seed_checkpoint(self) -> None:
        """Writes the initialized model as step-0, loadable at any layout."""
        if dist.get_world_size() != 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {dist.get_world_size()}"
            )
        check_seed_target(self.folder)
        self.write(0, parts=["model"])
        logger.info("seed checkpoint written to %s", os.path.join(self.folder, "step-0"))
        if newer := [path for step, path in complete_checkpoints(self.folder) if step > 0]:
            logger.warning("%s is newer: a run in this folder resumes from it, not from the seed", newer[0])

    def export_hf(self, model_args: Any, assets: ExportAssets) -> str:
        """Writes the model in Hugging Face's Llama layout to <folder>/hf (``checkpoint.export_dtype``)
        with ``assets``; returns that folder."""
        folder = os.path.join(self.folder, "hf")
        export_hf(self.model_parts, model_args, folder, getattr(torch, self.config.export_dtype), assets=assets)
        logger.info("Hugging Face export (%s) written to %s", self.config.export_dtype, folder)
        return folder

    def resume(self) -> int | None:
        """Loads the checkpoint to resume from: ``load_step`` if set (on the launch's first attempt),
        else the newest complete one that verifies and loads (older ones are tried after a bad one).
        Returns its step, or None when there is none."""
        # Only the launch's first attempt goes back to load_step: it moves the newer checkpoints aside
        # before loading, so those that torchrun's restarts find newer are this launch's own saves.
        first = is_first_attempt()
        # A restart's checkpoints were saved by this launch, or refused by its first attempt.
        restart = replace(self.config, load_step=-1, exclude_from_loading=[])
        check_resume(self.config if first else restart, self.folder)
        if first and self.config.load_step >= 0:
            path = complete_checkpoint_at(self.folder, self.config.load_step)
            try:
                self._load_checked(path, self._wanted_parts(path))
            except CheckpointError as e:  # a restart would fall back to another checkpoint
                raise ConfigError(f"checkpoint.load_step {self.config.load_step}: {e}") from None
            self._tidy_after_resume(self.config.load_step, chosen=True)
            return self.config.load_step
        return self._resume_newest()

    def _resume_newest(self) -> int | None:
        errors = []
        for step, path in complete_checkpoints(self.folder):
            try:
                self._load_checked(path, self._wanted_parts(path))
            except CheckpointError as e:
                logger.warning("cannot resume from %s: %s; trying the previous checkpoint", path, e)
                errors.append(f"step-{step}: {e}")
                continue
            self._tidy_after_resume(step)
            return step
        if errors:
            # Starting afresh would train from step 1 and save over them.
            raise ConfigError(
                f"checkpoint.folder: none of the checkpoints in {self.folder} loads ({'; '.join(errors)}); mend what "
                "this names, or move them away to start afresh"
            )
        self._tidy_after_resume(None)
        return None

    def rollback(self) -> int:
        """Reloads the newest complete checkpoint except its dataloader state, so that training goes
        on past the batches read since; returns its step."""
        self.wait()
        for step, path in complete_checkpoints(self.folder):
            try:
                self._load_checked(path, [p for p in self._wanted_parts(path) if p != "dataloader"])
            except CheckpointError as e:
                logger.warning("cannot roll back to %s: %s", path, e)
                continue
            return step
        raise CheckpointError(f"no complete checkpoint to roll back to in {self.folder}")

    def _wanted_parts(self, path: str) -> list[str]:
        """The parts to load from ``path``: all of a checkpoint this launch saved (torchrun's restart
        goes on from it), else all but those exclude_from_loading names."""
        if launch_id() and _read_marker(path, require_marker=False).get("launch") == launch_id():
            return list(CHECKPOINT_PARTS)
        return [part for part in CHECKPOINT_PARTS if part not in self.config.exclude_from_loading]

    def _verify(self, path: str, require_marker: bool, parts_to_load: list[str], option: str) -> set[str]:
        """Every rank verifies its share of the files, rank 0 reads the metadata; the verdicts are
        gathered, and the lowest rank's error, if any, is raised on every rank. Returns the parts
        the checkpoint holds; when the model is to be loaded, ``_check_same_model`` first."""
        error, parts, saved = None, set(), {}
        try:
            verify_files(path, require_marker, self.rank, dist.get_world_size(self.group))
            if self.rank == 0:
                metadata = _read_metadata(path)
                parts, saved = _parts_of(metadata), _model_shapes_of(metadata)
        except CheckpointError as e:
            error = str(e)
        verdicts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(verdicts, (error, sorted(parts), saved), group=self.group)
        errors = [error for error, *_ in verdicts if error is not None]
        if errors:
            raise CheckpointError(errors[0])
        _, parts, saved = verdicts[0]
        if "model" in parts_to_load and "model" in parts:
            self._check_same_model(path, saved, option)
        return set(parts)

    def _check_same_model(self, path: str, saved: dict[str, tuple[int, ...]], option: str) -> None:
        """A checkpoint of another model (other blocks, widths or vocabulary than all ranks' parts
        together) is a ConfigError naming ``option`` on every rank: loading it would fail, or
        fill only part of the model. Each rank sends which saved tensors it loads as bits, and
        its own differences, which are empty when the models match."""
        wanted = {f"model.{key}": tuple(value.shape) for key, value in self.states["model"].state_dict().items()}
        index = {key: i for i, key in enumerate(saved)}  # the same order on every rank: rank 0's
        loaded = sum(1 << index[key] for key in wanted if key in index)
        missing = [key for key in wanted if key not in index]
        reshaped = {key: shape for key, shape in wanted.items() if key in index and saved[key] != shape}
        reports: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, (loaded, missing, reshaped), group=self.group)
        loaded = functools.reduce(operator.or_, (bits for bits, _, _ in reports))
        difference = model_difference(
            saved,
            missing=list(dict.fromkeys(key for _, keys, _ in reports for key in keys)),
            extra=[key for key, i in index.items() if not loaded >> i & 1],
            reshaped={key: shape for _, _, shapes in reports for key, shape in shapes.items()},
        )
        if difference:
            raise ConfigError(another_model(option, path, difference))

    def _load_checked(
        self, path: str, parts: list[str], require_marker: bool = True, option: str = "checkpoint.folder"
    ) -> None:
        """Verifies (``_verify``), then loads the parts of ``parts`` that the checkpoint holds (a
        seed checkpoint holds only the model)."""
        present = self._verify(path, require_marker, parts, option)
        if "model" not in present:
            raise CheckpointError(f"{path} holds no model state")
        state = {part: self.states[part] for part in parts if part in present}
        # The options of the run that saved it, beside this run's.
        saved, own = _saved_config(path), tomllib.loads(self.resolved_config)
        if "dataloader" in state:
            _check_same_loader_workers(path, saved, own)
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"loading {path} failed{_describe(e)}") from None
        logger.info("loaded %s from %s", ", ".join(state), path)
        if self.rank == 0 and (changes := _restored_option_changes(saved, own, list(state))):
            logger.warning(
                "%s brings back the optimizer settings and LR schedule it was saved with; these options differ "
                "and do not count for them: %s",
                path,
                ", ".join(changes),
            )

    def _tidy_after_resume(self, loaded_step: int | None, chosen: bool = False) -> None:
        """Deletes folders of saves that never completed and moves aside complete ones newer than
        the step resumed from (they failed to load, or checkpoint.load_step chose an older one:
        ``chosen``), so that later saves start from empty folders (``check_resume`` has refused
        any other step-N entry). A ``load_only`` run, which saves nothing, changes nothing."""
        if self.config.load_only:
            return
        if self.rank == 0:
            for step, path in checkpoint_folders(self.folder):
                if not is_complete(path):
                    logger.info("removing incomplete checkpoint %s", path)
                    shutil.rmtree(path, ignore_errors=True)
                elif loaded_step is None or step > loaded_step:
                    aside = free_path(f"{path}.{'not-resumed' if chosen else 'unloadable'}")
                    os.rename(path, aside)
                    why = f"newer than checkpoint.load_step {loaded_step}" if chosen else "unloadable"
                    logger.warning("moved the checkpoint %s (%s) to %s", path, why, aside)
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Waits for the save in flight and for deletions."""
        try:
            self.wait()
        finally:
            self._purger.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
