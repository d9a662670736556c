"""Maps a job config to a pipeline of Llama 3 stages: the stage layout, this rank's stages (each
parallelized and materialized by the caller) and the schedule running them."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn as nn

from config.errors import ConfigError, user_input
from config.job_config import JobConfig
from parallelisms.device import device_type
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import (
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    PipelineLayout,
    Schedule,
    build_schedule,
    plan_pipeline,
    split_stage,
)
from parallelisms.torch_release import runs_v_schedules

logger = logging.getLogger(__name__)

PIPELINE_OPTIONS = {
    "pp_degree": "parallelism.pipeline_parallel_degree",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "split_points": "parallelism.pipeline_parallel_split_points",
    "module_fqns": "parallelism.module_fqns_per_model_part",
    "first_stage_less_layers": "parallelism.pipeline_parallel_first_stage_less_layers",
    "last_stage_less_layers": "parallelism.pipeline_parallel_last_stage_less_layers",
    "microbatch_size": "parallelism.pipeline_parallel_microbatch_size",
    "local_batch_size": "training.local_batch_size",
    "schedule_csv": "parallelism.pipeline_parallel_schedule_csv",
}
"""``plan_pipeline``'s parameters and the options that set them."""


@contextlib.contextmanager
def as_options(options: Mapping[str, str], option: str = "") -> Iterator[None]:
    """Reports a parallelism's ValueError as the ConfigError of ``user_input(option)``, each of its
    parameters (a key of ``options``) replaced by the option the user typed."""
    names = re.compile(r"\b(" + "|".join(map(re.escape, options)) + r")\b")
    with user_input(option):
        try:
            yield
        except ConfigError:
            raise
        except ValueError as e:
            raise ValueError(names.sub(lambda m: options[m.group()], str(e))) from None


def pipeline_layout(config: JobConfig, n_layers: int) -> PipelineLayout:
    """The pipeline stages and microbatch count that ``config`` asks for, for a model of
    ``n_layers`` blocks; a one-line ConfigError when they are impossible."""
    p = config.parallelism
    schedule = p.pipeline_parallel_schedule
    if config.validation.enable and schedule in V_SCHEDULES:
        # torch's forward-only run (schedule.eval) of a V-shaped pipeline fails at its same-rank hand-over.
        raise ConfigError(f"validation.enable: not supported with the {schedule} pipeline schedule")
    if schedule in ZERO_BUBBLE_SCHEDULES:
        # These schedules split backward into input- and weight-gradient passes, which a compiled
        # backward does not support and FSDP's reshard/re-gather breaks (None or wrong gradients).
        if config.compile.compiles_model:
            raise ConfigError(f"compile.enable: not supported with the {schedule} pipeline schedule")
        if config.compile.compiles_loss:  # its graph frees buffers its first backward pass uses
            raise ConfigError(
                f"compile.components: a compiled loss is not supported with the {schedule} pipeline schedule; "
                "leave loss out"
            )
        ac = config.activation_checkpoint
        if ac.mode == "selective" and ac.selective_ac_option == "op":
            # torch's op-level policy allows one backward pass through a region, and these take two.
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option: op is not supported with the {schedule} pipeline "
                "schedule; give a block interval, or mode full"
            )
        if p.fsdp_reshard_after_forward == "always":
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward: 'always' gives wrong gradients with the {schedule} "
                "pipeline schedule; use default or never"
            )
    with as_options(PIPELINE_OPTIONS):
        return plan_pipeline(
            n_layers=n_layers,
            pp_degree=p.pipeline_parallel_degree,
            schedule=schedule,
            layers_per_stage=p.pipeline_parallel_layers_per_stage,
            split_points=p.pipeline_parallel_split_points,
            module_fqns=p.module_fqns_per_model_part,
            local_batch_size=config.training.local_batch_size,
            microbatch_size=p.pipeline_parallel_microbatch_size,
            first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
            last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
            schedule_csv=p.pipeline_parallel_schedule_csv,
        )


def check_schedule_runs_here(schedule: str) -> None:
    """A ConfigError when this torch cannot run ``schedule`` on this machine's devices."""
    if schedule in V_SCHEDULES and not runs_v_schedules(device_type()):
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {schedule} needs torch 2.13 or newer on CPU ranks "
            f"(torch {torch.__version__} cannot start a V-shaped pipeline over gloo); choose another schedule"
        )


def pipeline_llama(
    model: nn.Module,
    parallel_dims: ParallelDims,
    config: JobConfig,
    device: torch.device,
    materialize: Callable[[nn.Module], nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[Schedule, list[nn.Module], bool, bool]:
    """Splits ``model`` (meta device) into this rank's stages, each passed through ``materialize``,
    and builds the schedule; returns it, the stages, and whether they hold the first and last stage."""
    layout = pipeline_layout(config, model.args.n_layers)
    check_schedule_runs_here(layout.schedule)
    logger.info("pipeline %s, %d microbatches per step:\n%s", layout.schedule, layout.n_microbatches, layout.describe())
    pp_rank = parallel_dims.pp_mesh.get_local_rank()
    stage_indices = layout.stage_indices(pp_rank)
    stages = [materialize(split_stage(model, layout, i)) for i in stage_indices]
    schedule = build_schedule(
        layout, stages, pp_rank=pp_rank, pp_group=parallel_dims.pp_mesh.get_group(), device=device, loss_fn=loss_fn
    )
    return schedule, stages, 0 in stage_indices, layout.num_stages - 1 in stage_indices
