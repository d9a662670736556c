"""Maps a job config to the parallelisms applied to a Llama 3 model, in a fixed order:
tensor parallel, activation checkpointing, compile, data parallel."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from parallelisms.activation_checkpoint import apply_ac
from parallelisms.fsdp2 import apply_ddp, apply_fsdp2
from trainer.config import JobConfig
from trainer.distributed import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_llama(
    model: nn.Module, parallel_dims: ParallelDims, mesh: DeviceMesh, config: JobConfig
) -> None:
    """Applies the configured parallelisms to ``model`` (built on the meta device) in place."""
    apply_ac(model.layers, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option)

    if not parallel_dims.dp_enabled:
        return
    param_dtype = DTYPES[config.training.mixed_precision_param]
    reduce_dtype = DTYPES[config.training.mixed_precision_reduce]
    if parallel_dims.fsdp_enabled:
        dp_dims = ("dp_replicate", "dp_shard") if parallel_dims.dp_replicate_enabled else ("dp_shard",)
        reshard = config.parallelism.fsdp_reshard_after_forward
        apply_fsdp2(
            model,
            mesh[dp_dims],
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard == "always" or (reshard == "default" and not parallel_dims.pp_enabled),
            blocks=list(model.layers.values()),
        )
    else:
        apply_ddp(model, mesh["dp_replicate"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)
