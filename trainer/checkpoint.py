"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``<dump_folder>/<checkpoint.folder>/step-N/``: every rank writes its shards, the
coordinator writes DCP's ``.metadata``, and rank 0 writes ``checkpoint_complete.json`` last,
listing every file and its size. Only folders with that marker are ever loaded, so a save cut short
by a crash is never resumed from, and a later truncated file is detected and named.

Model and optimizer state are saved under the model's own parameter names as DTensors, so DCP
reshards them when the next run uses another layout (data, tensor or pipeline parallel, FSDP2 or
SimpleFSDP). The dataloader state is one global stream position, valid for any number of
data-parallel ranks.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
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

from config.job_config import CHECKPOINT_PARTS, DTYPES, Checkpoint, ConfigError, user_input
from parallelisms.device import pinned_memory_available
from trainer.hf_checkpoint import export_hf, is_hf_folder, load_hf_weights

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "checkpoint_complete.json"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


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


class ModelState(Stateful):
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter name (not by position), so it reshards with the model."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self._OPTIONS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self._OPTIONS)


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


def _write_marker(path: str, step: int) -> None:
    files = {}
    for name in sorted(os.listdir(path)):
        if name != COMPLETE_MARKER and os.path.isfile(os.path.join(path, name)):
            files[name] = os.path.getsize(os.path.join(path, name))
    tmp = os.path.join(path, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, COMPLETE_MARKER))


def verify_checkpoint(path: str, require_marker: bool = True) -> set[str]:
    """Checks a complete checkpoint's files against its marker and reads its metadata; returns the
    top-level parts it holds (model, optimizer, ...). Raises CheckpointError naming the bad file.
    Without ``require_marker``, a DCP folder written elsewhere (no marker) is checked by its
    metadata alone."""
    marker = os.path.join(path, COMPLETE_MARKER)
    try:
        with open(marker) as f:
            expected = json.load(f)["files"]
    except FileNotFoundError:
        if require_marker or not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})") from None
        expected = {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is unreadable: {e}") from None
    for name, size in expected.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{file} is truncated or changed: {os.path.getsize(file)} bytes, expected {size}")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # an unpickling failure can be of any type
        raise CheckpointError(f"{os.path.join(path, '.metadata')} is corrupt: {type(e).__name__}: {e}") from None
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


# ---------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves (synchronously or in the background) and restores a run's state: the model parts,
    the optimizer, the LR scheduler, the dataloader and ``train_state`` (step and RNG).

    Only rank 0 touches folders as a whole (markers, deletion); at most one save is in flight, and
    the next save, a load or ``close`` waits for it. ``storage_writer(step, path)`` makes the
    writer of each save.
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
        storage_writer: Callable[[int, str], FileSystemWriter] = lambda step, path: FileSystemWriter(path),
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
        # from interleaving with training's collectives.
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[int, str, concurrent.futures.Future] | None = None
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
        """After training step ``step``: saves every ``checkpoint.interval`` steps and at
        ``last_step``; otherwise completes a background save that has finished."""
        if self.config.enable and (step % self.config.interval == 0 or step == last_step):
            self.write(step)
        else:
            self.poll()

    def write(self, step: int, parts: Iterable[str] = CHECKPOINT_PARTS) -> None:
        """Saves ``parts`` as step-``step``: written when it returns (sync), or copied and written
        in the background (async; call ``wait_for_staging`` before changing the saved tensors)."""
        self.wait()
        path = os.path.join(self.folder, f"step-{step}")
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "config.toml"), "w") as f:
                f.write(self.resolved_config)
        state = {part: self.states[part] for part in parts}
        writer = self.storage_writer(step, path)
        if self._stager is None:
            dcp.save(state, storage_writer=writer, process_group=self.group)
            self._finish(step, path)
            return
        response = dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=self._stager)
        assert isinstance(response, AsyncSaveResponse)  # given by the asynchronous stager
        self._staging = response.staging_completion
        self._pending = (step, path, response.upload_completion)

    def wait_for_staging(self) -> None:
        """Returns once the save in flight has copied the state: from then on the model and
        optimizer may change."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def poll(self) -> None:
        """Completes a finished background save (marker, purge) without waiting for one in flight."""
        if self._pending is not None and self._pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight, if any, and completes it."""
        self.wait_for_staging()
        if self._pending is None:
            return
        step, path, future = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as e:
            raise CheckpointError(f"saving {path} failed: {type(e).__name__}: {e}") from None
        self._finish(step, path)

    def _finish(self, step: int, path: str) -> None:
        if self.rank != 0:
            return
        _write_marker(path, step)
        logger.info("checkpoint saved: %s", path)
        if self.config.keep_latest_k > 0:
            self._purger.submit(self._purge, self.config.keep_latest_k)

    def _purge(self, keep: int) -> None:
        for _, path in complete_checkpoints(self.folder)[keep:]:
            # The marker goes first: a deletion cut short leaves an incomplete folder, never a
            # complete-looking one with files missing.
            os.remove(os.path.join(path, COMPLETE_MARKER))
            shutil.rmtree(path, ignore_errors=True)
            logger.info("checkpoint deleted (keep_latest_k=%d): %s", keep, path)

    # ------------------------------------------------------------------ loading

    def load_at_start(self) -> None:
        """Restores the newest complete checkpoint, or else loads ``checkpoint.initial_load_path``'s
        model weights (a DCP checkpoint folder or a Hugging Face folder)."""
        if self.config.enable and (step := self.resume()) is not None:
            logger.info("resumed from step %d", step)
            return
        path = self.config.initial_load_path
        if not path:
            return
        if not os.path.isdir(path):
            raise ConfigError(f"checkpoint.initial_load_path: {path} is not a folder")
        if is_hf_folder(path):
            with user_input("checkpoint.initial_load_path"):
                load_hf_weights(self.model_parts, path)
        else:
            self._load_checked(path, ["model"], require_marker=False)
        logger.info("initial weights loaded from %s", path)

    def write_seed_checkpoint(self) -> None:
        """Writes the initialized model as step-0, loadable at any layout."""
        if dist.get_world_size() != 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {dist.get_world_size()}"
            )
        self.write(0, parts=["model"])
        logger.info("seed checkpoint written to %s", os.path.join(self.folder, "step-0"))

    def export_hf(self, model_args: Any) -> str:
        """Writes the model in Hugging Face's Llama layout to <folder>/hf (``checkpoint.export_dtype``);
        returns that folder."""
        folder = os.path.join(self.folder, "hf")
        export_hf(self.model_parts, model_args, folder, DTYPES[self.config.export_dtype])
        logger.info("Hugging Face export (%s) written to %s", self.config.export_dtype, folder)
        return folder

    def resume(self) -> int | None:
        """Loads the checkpoint to resume from: ``load_step`` if set, else the newest complete one
        that verifies and loads (older ones are tried after a bad one). Returns its step, or None
        when there is none."""
        candidates = complete_checkpoints(self.folder)
        if self.config.load_step >= 0:
            chosen = [(step, path) for step, path in candidates if step == self.config.load_step]
            if not chosen:
                raise ConfigError(
                    f"checkpoint.load_step: no complete checkpoint step-{self.config.load_step} in {self.folder}"
                )
            self._load_checked(chosen[0][1], self._wanted_parts())
            self._tidy_after_resume(chosen[0][0])
            return chosen[0][0]
        for step, path in candidates:
            try:
                self._load_checked(path, self._wanted_parts())
            except CheckpointError as e:
                logger.warning("cannot resume from %s: %s; trying the previous checkpoint", path, e)
                continue
            self._tidy_after_resume(step)
            return step
        self._tidy_after_resume(None)
        return None

    def rollback(self) -> int:
        """Reloads the newest complete checkpoint except its dataloader state, so that training goes
        on past the batches read since; returns its step."""
        self.wait()
        for step, path in complete_checkpoints(self.folder):
            try:
                self._load_checked(path, [p for p in self._wanted_parts() if p != "dataloader"])
            except CheckpointError as e:
                logger.warning("cannot roll back to %s: %s", path, e)
                continue
            return step
        raise CheckpointError(f"no complete checkpoint to roll back to in {self.folder}")

    def _wanted_parts(self) -> list[str]:
        return [part for part in CHECKPOINT_PARTS if part not in self.config.exclude_from_loading]

    def _load_checked(self, path: str, parts: list[str], require_marker: bool = True) -> None:
        """Verifies on rank 0, shares the verdict, then loads the parts of ``parts`` that the
        checkpoint holds (a seed checkpoint holds only the model)."""
        verdict: list[Any] = [None]
        if self.rank == 0:
            try:
                verdict[0] = sorted(verify_checkpoint(path, require_marker))
            except CheckpointError as e:
                verdict[0] = str(e)
        dist.broadcast_object_list(verdict, src=0, group=self.group)
        if isinstance(verdict[0], str):
            raise CheckpointError(verdict[0])
        present = set(verdict[0])
        if "model" not in present:
            raise CheckpointError(f"{path} holds no model state")
        state = {part: self.states[part] for part in parts if part in present}
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group)
        except Exception as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"loading {path} failed: {first_line}") from None
        logger.info("loaded %s from %s", ", ".join(state), path)

    def _tidy_after_resume(self, loaded_step: int | None) -> None:
        """Deletes folders of saves that never completed and moves aside complete ones newer than
        the step resumed from (they failed to load), so that later saves start from empty folders."""
        if self.rank == 0:
            for step, path in checkpoint_folders(self.folder):
                if not is_complete(path):
                    logger.info("removing incomplete checkpoint %s", path)
                    shutil.rmtree(path, ignore_errors=True)
                elif loaded_step is None or step > loaded_step:
                    aside = f"{path}.unloadable"
                    shutil.rmtree(aside, ignore_errors=True)
                    os.rename(path, aside)
                    logger.warning("moved the unloadable checkpoint %s to %s", path, aside)
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Waits for the save in flight and for deletions."""
        self.wait()
        self._purger.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
