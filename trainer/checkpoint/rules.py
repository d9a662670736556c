"""The rules a job's checkpoint options must keep, checked by preflight and again by the ranks."""

from __future__ import annotations

import os
import re
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from config.errors import ConfigError
from config.job_config import RESOLVED_CONFIG_FILE, Checkpoint
from models.sizes import is_hf_folder
from trainer.checkpoint.hf import files_no_export_wrote
from trainer.checkpoint.integrity import (
    STEP_FOLDER,
    CheckpointError,
    complete_checkpoints,
    is_complete,
    model_shapes_of,
    read_metadata,
)

# What a save writes in its step folder: DCP's shards and metadata, the run's config, the marker.
_SAVE_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?|config\.toml|checkpoint_complete\.json(\.\d+\.tmp)?")
# The options whose values a loaded part brings back: the optimizer's settings, and the LR schedule
# (its peak and its shape, which training.steps sets unless lr_scheduler.total_steps does).
_RESTORED_OPTIONS = {
    "optimizer": "optimizer.beta1 optimizer.beta2 optimizer.eps optimizer.weight_decay".split(),
    "lr_scheduler": "optimizer.lr lr_scheduler.warmup_steps lr_scheduler.decay_type lr_scheduler.decay_ratio "
    "lr_scheduler.min_lr_factor lr_scheduler.total_steps training.steps".split(),
}


def check_resume(config: Checkpoint, folder: str) -> None:
    """ConfigError for a resume the options contradict: a missing ``load_step``, ``train_state``
    excluded from a resume, or (unless ``load_only``) a step-N entry a save would write into."""
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
    """What is wrong with the first step-N entry of ``folder`` that no save here left, if any (a
    file, other files than a save writes, or another tool's DCP checkpoint such as torchtitan's)."""
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not STEP_FOLDER.match(name) or is_complete(path):
            continue
        if not os.path.isdir(path):
            return f"{path} is a file, where a save writes a folder"
        names = os.listdir(path)
        ours = all(_SAVE_FILE.fullmatch(n) and os.path.isfile(os.path.join(path, n)) for n in names)
        # A save writes its config.toml first and DCP's .metadata last.
        if not ours or (".metadata" in names and RESOLVED_CONFIG_FILE not in names):
            return f"{path} holds files no save of this trainer wrote (another tool's checkpoint, or yours)"
    return None


def check_seed_checkpoint(folder: str, world_size: int) -> None:
    """A seed checkpoint is written by one process, and not over a step-0 checkpoint."""
    if world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {world_size}")
    path = os.path.join(folder, "step-0")
    if is_complete(path) or os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint: {path} already holds a checkpoint, which the seed would "
            "overwrite; move it aside or give another checkpoint.folder or job.dump_folder"
        )


def check_export_folder(folder: str) -> None:
    """The folder export_hf replaces holds no files but an export's, which would go with it."""
    if foreign := files_no_export_wrote(folder):
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"checkpoint.export_hf: {folder} holds files no export wrote ({shown}), which the export would "
            "delete with the folder it replaces; move them or give another checkpoint.folder or job.dump_folder"
        )


def complete_checkpoint_at(folder: str, step: int) -> str:
    """The path of the complete checkpoint of ``step`` in ``folder`` (``checkpoint.load_step``)."""
    paths = dict(complete_checkpoints(folder))
    if step not in paths:
        raise ConfigError(f"checkpoint.load_step: no complete checkpoint step-{step} in {folder}")
    return paths[step]


def initial_load_problem(checkpoint: Checkpoint) -> str | None:
    """What is wrong with ``checkpoint.initial_load_path`` before reading it, if anything."""
    path = checkpoint.initial_load_path
    if not path:
        return None
    if not os.path.isdir(path):
        return f"checkpoint.initial_load_path: {path} is not a folder"
    if not is_hf_folder(path):
        if not os.path.isfile(os.path.join(path, ".metadata")):
            return f"checkpoint.initial_load_path: {path} is neither a DCP checkpoint nor a Hugging Face folder"
        return None
    if not checkpoint.initial_load_model_only:
        return (
            f"checkpoint.initial_load_model_only: false loads a training checkpoint's state, but {path} is a "
            "Hugging Face folder of weights only"
        )
    return None


def saved_config(path: str) -> dict[str, Any]:
    """The options of the run that saved ``path``; empty for another tool's checkpoint or a damaged one."""
    try:
        with open(os.path.join(path, RESOLVED_CONFIG_FILE), "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def check_same_loader_workers(path: str, saved: dict[str, Any], own: dict[str, Any]) -> None:
    """The data position is each loader worker's: it loads only under as many workers."""
    before = saved.get("training", {}).get("dataloader_num_workers")
    now = own.get("training", {}).get("dataloader_num_workers")
    if before is not None and now is not None and before != now:
        raise ConfigError(
            f"training.dataloader_num_workers {now}: the data position in {path} was saved by {before}; keep "
            f"{before}, or start the data over with --checkpoint.exclude_from_loading dataloader"
        )


def restored_option_changes(saved: dict[str, Any], own: dict[str, Any], parts: list[str]) -> list[str]:
    """The options the loaded ``parts`` bring back that ``own`` sets otherwise than ``saved``."""
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


def another_model(option: str, path: str, difference: str) -> str:
    """The line for a checkpoint whose model is not the job's."""
    return f"{option}: {path} holds another model than this job's: {difference}"


def saved_model_difference(path: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the checkpoint at ``path`` differs from a whole model's ``shapes``, from its metadata alone."""
    try:
        saved = model_shapes_of(read_metadata(path))
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
    """How a checkpoint's model tensors (``saved``) differ from a model's, in a few words; None if not."""
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
