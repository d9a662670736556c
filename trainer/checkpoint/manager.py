"""Distributed checkpoints (torch DCP) in ``<dump_folder>/<checkpoint.folder>/step-N/``: every rank
writes its shards, rank 0 the marker (``integrity``) last. The dataloader state is one global stream
position, valid for any number of data-parallel ranks."""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import logging
import operator
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from config.errors import ConfigError, typed_first_line, user_input
from config.job_config import CHECKPOINT_PARTS, RESOLVED_CONFIG_FILE, Checkpoint
from models.sizes import is_hf_folder
from parallelisms.device import pinned_memory_available
from parallelisms.torch_release import reusable_checkpoint_stager
from trainer.checkpoint import integrity, rules
from trainer.checkpoint.elastic import layout_change, layout_of, marker_layout
from trainer.checkpoint.hf import ExportAssets, export_hf, load_hf_weights
from trainer.checkpoint.integrity import CheckpointError, ChecksummedWriter, complete_checkpoints
from trainer.checkpoint.state import ModelState, OptimizerState, TrainState, whole_model
from trainer.distributed import is_first_attempt, launch_id
from trainer.folders import free_path

logger = logging.getLogger(__name__)


def _save_failed(path: str, error: BaseException) -> CheckpointError:
    """One line for a failed save; names a full disk, which torch reports as a position not reached."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = _FULL_DISK_BYTES
    disk = f" (its disk is full: {free} bytes free)" if free < _FULL_DISK_BYTES else ""
    return CheckpointError(f"saving {path} failed{_describe(error)}{disk}")


_FULL_DISK_BYTES = 2**20


def _describe(error: BaseException) -> str:
    """': Type: first line' of an error; of DCP's lowest failing rank's (' on rank R: ...')."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        return f" on rank {rank}: {typed_first_line(cause)}"
    return f": {typed_first_line(error)}"


@dataclass
class _Save:
    """A save in flight; its writer holds the CRCs."""

    step: int
    path: str
    done: concurrent.futures.Future
    writer: FileSystemWriter


class CheckpointManager:
    """Saves (also in the background) and restores a run's state; at most one save is in flight. A
    failed save raises CheckpointError naming its folder, which has no marker, so never loads."""

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
        if config.export_hf:
            rules.check_export_folder(os.path.join(self.folder, "hf"))
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
        self.layout = layout_of(tomllib.loads(resolved_config), dist.get_world_size())
        self.storage_writer = storage_writer
        self.rank = dist.get_rank()
        # Background saves run collectives from another thread: a group of their own keeps them
        # from interleaving with training's (set_collective_timeout later sets its timeout).
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

    def save(self, step: int, last_step: int) -> None:
        """Saves when ``step`` is due (interval, last step, first step if asked), else polls."""
        first = step == 1 and self.config.enable_first_step_checkpoint
        due = step % self.config.interval == 0 or step == last_step or first
        if self.config.enable and not self.config.load_only and due:
            self.write(step)
        else:
            self.poll()

    def write(self, step: int, parts: Iterable[str] = CHECKPOINT_PARTS) -> None:
        """Saves ``parts`` as step-``step``; async: call ``wait_for_staging`` before changing them."""
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
                if not reusable_checkpoint_stager():
                    self._stager.close()
                    self._stager = self._build_stager()
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
        """Returns once the save in flight has copied the state, which may then change."""
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
            layout = asdict(self.layout) if self.layout is not None else None
            integrity.write_marker(path, step, getattr(writer, "checksums", {}), launch_id(), layout)
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
                os.remove(os.path.join(path, integrity.COMPLETE_MARKER))
                shutil.rmtree(path)
            except OSError as e:  # in the purge's thread, which nothing waits on for an error
                logger.warning("deleting %s (keep_latest_k=%d) failed: %s", path, keep, typed_first_line(e))
                continue
            logger.info("checkpoint deleted (keep_latest_k=%d): %s", keep, path)

    def load_at_start(self) -> str | None:
        """Restores the newest checkpoint, else initial_load_path; returns the folder of a whole state."""
        if self.config.enable and (step := self.resume()) is not None:
            logger.info("resumed from step %d", step)
            path = os.path.join(self.folder, f"step-{step}")
            if self.rank == 0 and self.layout and (change := layout_change(step, marker_layout(path), self.layout)):
                logger.info("%s", change)
            if self.config.initial_load_path and is_first_attempt():  # a restart's own resume goes without saying
                logger.warning(
                    "checkpoint.initial_load_path %s is not loaded: a run resumes from its own checkpoints first "
                    "(step-%d); give another checkpoint.folder or job.dump_folder to start from it",
                    self.config.initial_load_path,
                    step,
                )
            return path
        path = self.config.initial_load_path
        if not path:
            return None
        if problem := rules.initial_load_problem(self.config):
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
        rules.check_seed_checkpoint(self.folder, dist.get_world_size())
        self.write(0, parts=["model"])
        logger.info("seed checkpoint written to %s", os.path.join(self.folder, "step-0"))
        if newer := [path for step, path in complete_checkpoints(self.folder) if step > 0]:
            logger.warning("%s is newer: a run in this folder resumes from it, not from the seed", newer[0])

    def export_hf(self, model_args: Any, assets: ExportAssets) -> str:
        """Writes the model as a Hugging Face folder to <folder>/hf; returns that folder."""
        folder = os.path.join(self.folder, "hf")
        export_hf(self.model_parts, model_args, folder, getattr(torch, self.config.export_dtype), assets=assets)
        logger.info("Hugging Face export (%s) written to %s", self.config.export_dtype, folder)
        return folder

    def resume(self) -> int | None:
        """Loads ``load_step``, else the newest complete checkpoint that loads; returns its step."""
        # Only the first attempt goes back to load_step: it moves newer checkpoints aside, so those a
        # restart finds newer are this launch's own saves (its first attempt refused any others).
        first = is_first_attempt()
        restart = replace(self.config, load_step=-1, exclude_from_loading=[])
        rules.check_resume(self.config if first else restart, self.folder)
        if first and self.config.load_step >= 0:
            path = rules.complete_checkpoint_at(self.folder, self.config.load_step)
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
        """Reloads the newest checkpoint but its data position (training goes on past those batches)."""
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
        """All parts of a checkpoint this launch saved (a restart), else all but exclude_from_loading's."""
        if launch_id() and integrity.read_marker(path, require_marker=False).get("launch") == launch_id():
            return list(CHECKPOINT_PARTS)
        return [part for part in CHECKPOINT_PARTS if part not in self.config.exclude_from_loading]

    def _verify(self, path: str, require_marker: bool, parts_to_load: list[str], option: str) -> set[str]:
        """Every rank verifies its share and raises the lowest rank's error; returns the parts held."""
        error, parts, saved = None, set(), {}
        try:
            integrity.verify_files(path, require_marker, self.rank, dist.get_world_size(self.group))
            if self.rank == 0:
                metadata = integrity.read_metadata(path)
                parts, saved = integrity.parts_of(metadata), integrity.model_shapes_of(metadata)
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
        """A ConfigError on every rank for a checkpoint of another model than the ranks' parts together."""
        wanted = {f"model.{key}": tuple(value.shape) for key, value in self.states["model"].state_dict().items()}
        index = {key: i for i, key in enumerate(saved)}  # the same order on every rank: rank 0's
        loaded = sum(1 << index[key] for key in wanted if key in index)
        missing = [key for key in wanted if key not in index]
        reshaped = {key: shape for key, shape in wanted.items() if key in index and saved[key] != shape}
        reports: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, (loaded, missing, reshaped), group=self.group)
        loaded = functools.reduce(operator.or_, (bits for bits, _, _ in reports))
        difference = rules.model_difference(
            saved,
            missing=list(dict.fromkeys(key for _, keys, _ in reports for key in keys)),
            extra=[key for key, i in index.items() if not loaded >> i & 1],
            reshaped={key: shape for _, _, shapes in reports for key, shape in shapes.items()},
        )
        if difference:
            raise ConfigError(rules.another_model(option, path, difference))

    def _load_checked(
        self, path: str, parts: list[str], require_marker: bool = True, option: str = "checkpoint.folder"
    ) -> None:
        """Verifies, then loads those of ``parts`` the checkpoint holds (a seed: only the model)."""
        present = self._verify(path, require_marker, parts, option)
        if "model" not in present:
            raise CheckpointError(f"{path} holds no model state")
        state = {part: self.states[part] for part in parts if part in present}
        saved, own = rules.saved_config(path), tomllib.loads(self.resolved_config)
        if "dataloader" in state:
            rules.check_same_loader_workers(path, saved, own)
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group)
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"loading {path} failed{_describe(e)}") from None
        logger.info("loaded %s from %s", ", ".join(state), path)
        if self.rank == 0 and (changes := rules.restored_option_changes(saved, own, list(state))):
            logger.warning(
                "%s brings back the optimizer settings and LR schedule it was saved with; these options differ "
                "and do not count for them: %s",
                path,
                ", ".join(changes),
            )

    def _tidy_after_resume(self, loaded_step: int | None, chosen: bool = False) -> None:
        """Deletes incomplete saves and moves aside complete ones newer than ``loaded_step``
        (unloadable, or older by load_step's choice), so that later saves start from empty folders."""
        if self.config.load_only:
            return
        if self.rank == 0:
            for step, path in integrity.checkpoint_folders(self.folder):
                if not integrity.is_complete(path):
                    logger.info("removing incomplete checkpoint %s", path)
                    shutil.rmtree(path, ignore_errors=True)
                elif loaded_step is None or step > loaded_step:
                    aside = free_path(f"{path}.{'not-resumed' if chosen else 'unloadable'}")
                    os.rename(path, aside)
                    why = f"newer than checkpoint.load_step {loaded_step}" if chosen else "unloadable"
                    logger.warning("moved the checkpoint %s (%s) to %s", path, why, aside)
        dist.barrier(group=self.group)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._purger.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
