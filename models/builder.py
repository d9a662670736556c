"""Building a model as training does: on the meta device, split into this rank's pipeline stages,
parallelized, then allocated and initialized (a model of any size only ever exists sharded)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from config.job_config import JobConfig, Training
from models.registry import get_flavor, get_model_spec
from parallelisms.bucketing import BucketingPass
from parallelisms.device import attention_dtype, causal_query_chunk, document_kernel, fast_bfloat16
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline import Schedule
from parallelisms.tensor_parallel import local_loss

logger = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """A parallelized, initialized model, or this rank's pipeline stages and their schedule."""

    parts: list[nn.Module]
    args: Any  # the family's hyper-parameters
    flops_per_token: float  # training FLOPs per token of the whole model, for MFU
    compute_dtype: torch.dtype  # of the matmuls (training.mixed_precision_param, decided)
    # Forwards under torch.autocast (no wrapper casts the weights): activations stay in the weights' dtype.
    autocast: bool
    graph_passes: list[BucketingPass] = field(default_factory=list)  # SimpleFSDP's, per compiled part
    schedule: Schedule | None = None
    has_first_stage: bool = True
    has_last_stage: bool = True

    def run_pipeline(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, train: bool, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Runs the schedule: the sum of the microbatches' losses on the last stage's rank, zero elsewhere.
        ``positions`` (document masking) reach every stage's forward, split into microbatches as the inputs."""
        losses: list[torch.Tensor] = []
        stage_inputs = (inputs,) if self.has_first_stage else ()
        targets = labels if self.has_last_stage else None
        run = self.schedule.step if train else self.schedule.eval
        # torch's schedules hand keyword arguments to every stage, not only the first.
        keywords = {} if positions is None else {"positions": positions}
        run(*stage_inputs, target=targets, losses=losses, return_outputs=False, **keywords)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([local_loss(loss.detach()) for loss in losses]).sum()


def _describe(config: JobConfig, args: Any) -> str:
    """The flavor's name and the fields where ``args`` differ from it."""
    flavor = dataclasses.asdict(get_flavor(get_model_spec(config.model.name), config.model.flavor))
    changed = [f"{k}={v}" for k, v in dataclasses.asdict(args).items() if v != flavor[k] and k != "max_seq_len"]
    return config.model.flavor + (f" with {', '.join(changed)}" if changed else "")


def resolve_precision(config: JobConfig, device_type: str) -> JobConfig:
    """``config`` with ``mixed_precision_param = "auto"`` decided for ``device_type``."""
    training = config.training
    if training.dtype == "bfloat16":
        logger.info("training.dtype bfloat16: weights, gradients and optimizer state in bfloat16, no float32 copy")
        return dataclasses.replace(config, training=dataclasses.replace(training, mixed_precision_param="bfloat16"))
    if training.mixed_precision_param != "auto":
        return config
    fast, device = fast_bfloat16(device_type)
    param = "bfloat16" if fast else "float32"
    logger.info(
        f"training.mixed_precision_param auto -> {param}: {device} has {'' if fast else 'no '}fast bf16 matmuls"
    )
    return dataclasses.replace(config, training=dataclasses.replace(training, mixed_precision_param=param))


def wrapper_casts_parameters(config: JobConfig, parallel_dims: ParallelDims) -> bool:
    """Whether the DP wrapper casts the parameters (sharding and SimpleFSDP do); else autocast casts."""
    if not parallel_dims.dp_cp_enabled:
        return False
    return parallel_dims.fsdp_enabled or config.parallelism.data_parallel_impl == "simple_fsdp"


def _log_precision(config: JobConfig, parallel_dims: ParallelDims) -> None:
    """One line when mixed precision is on: what casts, and what stays float32."""
    param, reduce = config.training.mixed_precision_param, config.training.mixed_precision_reduce
    if wrapper_casts_parameters(config, parallel_dims):
        if (param, reduce) != (config.training.dtype, "float32"):
            logger.info(
                "mixed precision: %s parameters in forward and backward, gradients reduced in %s", param, reduce
            )
        return
    reduced = f" (reduced in {reduce})" if parallel_dims.dp_cp_enabled and reduce != "float32" else ""
    if param != config.training.dtype:
        logger.info("mixed precision: forward under %s autocast, float32 weights and gradients%s", param, reduced)
    elif reduced:
        logger.info("mixed precision: gradients reduced in %s", reduce)


def document_masking(training: Training, args: Any) -> bool:
    """Whether packed documents are kept apart: training.document_masking on, or auto with chat data
    or a flavor whose attention is block-causal (torchtitan's flex and varlen ones)."""
    block_causal = getattr(args, "attn_mask_type", "causal") == "block_causal"
    if training.document_masking == "off" and block_causal:
        logger.info(
            "training.document_masking off: the flavor's block-causal attention is off, packed documents see each other"
        )
    masking = training.document_masking == "on" or (
        training.document_masking == "auto" and (training.dataset_format == "chat" or block_causal)
    )
    if masking:
        logger.info("document masking: packed documents attend within themselves, positions restart per document")
    return masking


def build_model(
    config: JobConfig,
    parallel_dims: ParallelDims,
    device: torch.device,
    args: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    fake_mode: FakeTensorMode | None = None,
) -> BuiltModel:
    """The model of ``args`` on ``parallel_dims.mesh``; ``loss_fn`` is what the last pipeline stage
    computes. With ``fake_mode`` (a dry run) the weights are fake tensors: no memory."""
    config = resolve_precision(config, device.type)
    spec = get_model_spec(config.model.name)
    with torch.device("meta"):
        model = spec.model_cls(args).to(getattr(torch, config.training.dtype))
    logger.info(
        "%s %s: %.2fM parameters", spec.name, _describe(config, args), sum(p.numel() for p in model.parameters()) / 1e6
    )
    compute_dtype = getattr(torch, config.training.mixed_precision_param)
    # A dry run stands for GPUs, whose attention needs neither.
    upcast = None if fake_mode else attention_dtype(device.type, compute_dtype, args.head_dim)
    query_chunk = None if fake_mode else causal_query_chunk(device.type, config.training.seq_len)
    if upcast is not None:
        names = [str(dtype).removeprefix("torch.") for dtype in (upcast, compute_dtype)]
        logger.info("attention in %s: faster than %s for heads of %d on %s", *names, args.head_dim, device.type)
    if query_chunk is not None:
        logger.info(
            f"attention over queries in chunks of {query_chunk} at seq {config.training.seq_len}: faster than "
            f"{device.type}'s causal kernel, which masks keys it could skip"
        )
    model.configure_attention(upcast, query_chunk, document_kernel(device.type))
    _log_precision(config, parallel_dims)
    # Without a casting wrapper autocast casts the matmuls; weights in the compute dtype need neither.
    casts = wrapper_casts_parameters(config, parallel_dims) or compute_dtype == getattr(torch, config.training.dtype)
    flops = spec.flops_per_token_fn(args, model, config.training.seq_len)
    built = BuiltModel([], args, flops, compute_dtype, autocast=not casts)

    def materialize(module: nn.Module) -> nn.Module:
        graph_pass = spec.parallelize_fn(module, parallel_dims, config)
        if graph_pass is not None:
            built.graph_passes.append(graph_pass)
        # Parallelizing stays outside fake mode: the mesh's coordinate lookups need real tensors.
        with fake_mode or contextlib.nullcontext(), torch.no_grad():
            # Offloaded: the sharded weights (and so gradients and optimizer state) in host memory.
            module.to_empty(device=torch.device("cpu") if config.training.enable_cpu_offload else device)
            module.init_weights(buffer_device=device, seed=config.debug.seed)
        if built.autocast:
            module.forward = torch.autocast(device.type, dtype=compute_dtype)(module.forward)
        return module.train()

    if parallel_dims.pp_enabled:
        built.schedule, built.parts, built.has_first_stage, built.has_last_stage = spec.pipelining_fn(
            model, parallel_dims, config, device, materialize, loss_fn
        )
    else:
        built.parts = [materialize(model)]
    return built
