"""A run resumed at another world size (an elastic job, NNODES=MIN:MAX, that lost a node or got it
back): the layout re-derived for the ranks there are, the same global batch (more or fewer
gradient-accumulation microbatches), and one line saying what changed. Each checkpoint's marker
records the layout it was saved at; it is read before the model is built, since the layout decides
how the model is sharded. The run's resolved config (config.toml) then holds the re-derived degrees
and the kept global batch."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from config.errors import ConfigError
from config.job_config import JobConfig, Parallelism, Training
from config.rules import batch_layout
from trainer.checkpoint.integrity import CheckpointError, complete_checkpoints, read_marker
from trainer.distributed import elastic_parallelism, is_first_attempt


@dataclass(frozen=True)
class RunLayout:
    """The ranks a checkpoint was saved with and how they made up its global batch."""

    world_size: int
    dp_degree: int
    gradient_accumulation: int
    global_batch_size: int


def marker_layout(path: str) -> RunLayout | None:
    """The layout recorded in the marker of checkpoint ``path`` (None for one saved without it)."""
    try:
        saved = read_marker(path, require_marker=False).get("layout")
        return RunLayout(**saved) if isinstance(saved, dict) else None
    except (CheckpointError, TypeError):
        return None  # loading it says what is wrong


def resumed_layout(config: JobConfig) -> tuple[int, RunLayout] | None:
    """(step, layout) of the checkpoint the run resumes from: checkpoint.load_step's at the launch's
    first start, else the newest complete one (every rank reads its marker, as the load does)."""
    if not config.checkpoint.enable:
        return None
    checkpoints = complete_checkpoints(os.path.join(config.job.dump_folder, config.checkpoint.folder))
    if config.checkpoint.load_step >= 0 and is_first_attempt():
        checkpoints = [(step, path) for step, path in checkpoints if step == config.checkpoint.load_step]
    if checkpoints and (layout := marker_layout(checkpoints[0][1])) is not None:
        return checkpoints[0][0], layout
    return None


def fitted_to_world(config: JobConfig, world_size: int) -> JobConfig:
    """``config`` for a run at ``world_size`` ranks: unchanged unless it resumes a checkpoint saved at
    another world size; then the layout re-derived and, when training.global_batch_size is unset, the
    saved global batch set (the default one of the world the run started at)."""
    resumed = resumed_layout(config)
    if resumed is None or resumed[1].world_size == world_size:
        return config
    step, saved = resumed
    training = config.training
    if training.global_batch_size <= 0:
        training = dataclasses.replace(training, global_batch_size=saved.global_batch_size)
    parallelism = elastic_parallelism(config.parallelism, world_size)
    try:
        batch_layout(training, _dp_degree(parallelism, world_size))
    except ConfigError:
        raise ConfigError(
            f"training.global_batch_size: the run's global batch of {training.global_batch_size} sequences "
            f"(checkpoint step-{step}, saved at {saved.world_size} ranks) cannot be kept at {world_size} ranks: "
            f"it is not divisible by training.local_batch_size {training.local_batch_size} x data-parallel "
            f"degree {_dp_degree(parallelism, world_size)}; set training.global_batch_size to a multiple of that"
        ) from None
    return dataclasses.replace(config, parallelism=parallelism, training=training)


def _dp_degree(parallelism: Parallelism, world_size: int) -> int:
    others = parallelism.tensor_parallel_degree * parallelism.context_parallel_degree
    return world_size // (others * parallelism.pipeline_parallel_degree)


def layout_of(resolved: dict[str, Any], world_size: int) -> RunLayout | None:
    """The layout of a run of this resolved config (as TOML reads it) at ``world_size`` ranks; None
    for a config without its parallelism and training sections."""
    try:
        parallelism = Parallelism(**resolved["parallelism"])
        training = Training(**resolved["training"])
    except (KeyError, TypeError):
        return None
    dp = _dp_degree(parallelism, world_size)
    global_batch, accumulation = batch_layout(training, dp)
    return RunLayout(world_size, dp, accumulation, global_batch)


def layout_change(step: int, saved: RunLayout | None, own: RunLayout) -> str | None:
    """The line saying how the run's layout changed since checkpoint ``step``, if its world did."""
    if saved is None or saved.world_size == own.world_size:
        return None
    return (
        f"world {saved.world_size} -> {own.world_size} ranks (from checkpoint step {step}): "
        f"dp {saved.dp_degree} -> {own.dp_degree}, gradient accumulation {saved.gradient_accumulation} -> "
        f"{own.gradient_accumulation}, global batch {own.global_batch_size}"
    )
