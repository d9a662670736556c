"""Maps a job config to the parallelisms applied to a Llama 3 model, in a fixed order: float8
conversion, tensor parallel, context parallel, activation checkpointing, compile, data parallel
(context parallelism shards the parameters with the data-parallel ranks; SimpleFSDP is
compiled after data parallel, so that its gathers are traced with the compute)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from config.errors import ConfigError, user_input
from config.job_config import JobConfig
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.bucket_plan import (
    BucketPlan,
    PlanUnit,
    default_manual_patterns,
    plan_auto,
    plan_manual,
    saved_or_new_plan,
)
from parallelisms.bucketing import BucketingPass, data_parallel_groups
from parallelisms.compile import apply_compile_per_block, apply_compile_regions, apply_compile_whole_model
from parallelisms.cost_model import CommModel, ComputeModel, calibrate_comm_model, measure_rate
from parallelisms.device import (
    attention_dtype,
    causal_query_chunk,
    device_type,
    pinned_memory_available,
    supports_async_tp,
)
from parallelisms.float8 import apply_float8, check_filter_fqns, check_float8
from parallelisms.fsdp2 import apply_ddp, apply_fsdp2
from parallelisms.parallel_dims import ParallelDims
from parallelisms.simple_fsdp import apply_simple_fsdp
from parallelisms.tensor_parallel import apply_tp, validate_tp

from .context_parallel import apply_cp
from .model import Transformer, TransformerBlock, TransformerModelArgs, check_args, precompute_rope_cache
from .pipeline import as_options, check_schedule_runs_here, pipeline_layout

logger = logging.getLogger(__name__)

# Block bucketing: the units of one compiled block's graph (paths inside the block), in forward
# order; the feed-forward's gather is prefetched while attention computes.
BLOCK_BUCKETS = [["attention_norm", "attention"], ["ffn_norm", "feed_forward"]]

# Whole-model compile: these modules of every block compile once, as nested compile regions of plain
# modules (no tensor parallel DTensors, no checkpoint around them); two per block, so that backward
# can re-gather between them (a region's compute cannot be split).
REGIONS = ("attention", "feed_forward")

TP_OPTIONS = {
    "tp_degree": "parallelism.tensor_parallel_degree",
    "max_seq_len": "training.seq_len",  # the model is built with the training sequence length
    "enable_async_tp": "parallelism.enable_async_tensor_parallel",
}
FLOAT8_OPTIONS = {"emulate": "float8.emulate"}
"""The parameters of the parallelisms that their error messages name, and the options setting them."""

SAVED_PLANS = "bucket_plans"  # in the dump folder: auto bucket plans kept for restarts


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, config: JobConfig) -> BucketingPass | None:
    """Applies the configured parallelisms to ``model`` (on the meta device) in place. Returns
    SimpleFSDP's graph pass when it compiles the model (its reports describe the graphs), else None."""
    _check_tied(model.args, parallel_dims)
    _convert(model, parallel_dims, config)
    templates = _region_templates(model, parallel_dims, config)
    if parallel_dims.tp_enabled:
        with as_options(TP_OPTIONS):
            apply_tp(
                model,
                parallel_dims.tp_mesh,
                loss_parallel=config.parallelism.enable_loss_parallel,
                enable_async_tp=_async_tp(config, parallel_dims.tp_mesh.device_type),
            )
    apply_cp(model, parallel_dims.cp_mesh, config.parallelism.context_parallel_rotate_method)
    ac = config.activation_checkpoint
    apply_ac(
        model.layers,
        ac.mode,
        ac.selective_ac_option,
        early_stop=ac.early_stop,
        preserve_rng_state=ac.preserve_rng_state,
        determinism_check=ac.determinism_check,
        debug=ac.debug,
    )

    simple_fsdp = config.parallelism.data_parallel_impl == "simple_fsdp"
    budget = ac.memory_budget if ac.mode == "memory_budget" else 1.0
    if config.compile.compiles_model and not simple_fsdp:
        apply_compile_per_block(model.layers, config.compile.backend, memory_budget=budget)

    check_offload(parallel_dims, config)
    if parallel_dims.dp_cp_enabled:
        (_apply_simple_fsdp if simple_fsdp else _apply_fsdp2)(model, parallel_dims, config)

    if not (config.compile.compiles_model and simple_fsdp):
        return None
    dp_groups = data_parallel_groups(parallel_dims.dp_param_mesh) if parallel_dims.dp_enabled else []
    if config.compile.bucketing == "block":
        graph_pass = BucketingPass(BLOCK_BUCKETS if parallel_dims.dp_enabled else None, dp_groups)
        apply_compile_per_block(model.layers, config.compile.backend, graph_pass, budget)
        return graph_pass
    plan = bucket_plan(model, parallel_dims, config, os.path.join(config.job.dump_folder, SAVED_PLANS))
    if plan is not None:
        logger.info("SimpleFSDP %s bucket plan:\n%s", config.compile.bucketing, plan.describe())
    graph_pass = _bucketing_pass(plan, dp_groups, config)
    for name, template in templates.items():
        apply_compile_regions([getattr(block, name) for block in model.layers.values()], template)
    apply_compile_whole_model(model, config.compile.backend, graph_pass, budget)
    return graph_pass


def _region_templates(model: nn.Module, parallel_dims: ParallelDims, config: JobConfig) -> dict[str, nn.Module]:
    """Copies of the first block's ``REGIONS``, taken before any parallelism, when whole-model compile
    of SimpleFSDP compiles them as nested regions; else none."""
    first = next(iter(model.layers.values()), None)  # None on a pipeline stage without blocks
    regions = (
        config.compile.compiles_model
        and config.parallelism.data_parallel_impl == "simple_fsdp"
        and config.compile.bucketing != "block"
        and not (parallel_dims.tp_enabled or parallel_dims.cp_enabled)
        and config.activation_checkpoint.mode == "none"
        and first is not None
        # A region takes attention's positional inputs; a document or context-parallel mask is a keyword.
        and model.args.attn_mask_type == "causal"
    )
    return {name: copy.deepcopy(getattr(first, name)) for name in REGIONS} if regions else {}


def _bucketing_pass(plan: BucketPlan | None, dp_groups: list[str], config: JobConfig) -> BucketingPass:
    p = config.parallelism  # unset prefetch limits: one bucket ahead
    return BucketingPass(
        [bucket.units for bucket in plan.buckets] if plan is not None else None,
        dp_groups,
        forward_prefetch=p.fsdp_forward_prefetch or 1,
        backward_prefetch=p.fsdp_backward_prefetch or 1,
    )


def _convert(model: nn.Module, parallel_dims: ParallelDims, config: JobConfig) -> None:
    """model.converters, then model.print_after_conversion."""
    if "float8" in config.model.converters:
        _apply_float8(model, parallel_dims, config)
    if config.model.print_after_conversion:
        logger.info("model after conversion:\n%s", model)


def _apply_float8(model: nn.Module, parallel_dims: ParallelDims, config: JobConfig) -> None:
    f8 = config.float8
    # Without sharding there is no gather to make in float8.
    all_gather = f8.enable_fsdp_float8_all_gather and parallel_dims.fsdp_enabled
    with as_options(FLOAT8_OPTIONS, "model.converters"):
        check_float8(device_type(), f8.emulate)
        swapped = apply_float8(
            model,
            recipe_name=f8.recipe_name,
            filter_fqns=f8.filter_fqns,
            emulate=f8.emulate,
            fsdp_float8_all_gather=all_gather,
        )
    logger.info(
        "float8 %s: %d linear layers converted%s",
        f8.recipe_name,
        len(swapped),
        ", gathered in float8 by FSDP2" if all_gather else "",
    )


def _async_tp(config: JobConfig, device_type: str) -> bool:
    """Async TP only overlaps communication: where it cannot run (off CUDA) the run goes on without it."""
    wanted = config.parallelism.enable_async_tensor_parallel
    if wanted and not supports_async_tp(device_type):
        logger.warning("parallelism.enable_async_tensor_parallel needs CUDA: off on %s", device_type)
    return wanted and supports_async_tp(device_type)


def _reshard_after_forward(parallel_dims: ParallelDims, config: JobConfig) -> bool:
    # Pipeline microbatches would re-gather every time: keep weights gathered under PP by default.
    setting = config.parallelism.fsdp_reshard_after_forward
    return setting == "always" or (setting == "default" and not parallel_dims.pp_enabled)


def check_offload(parallel_dims: ParallelDims, config: JobConfig) -> None:
    """CPU offload keeps the shards of sharded data parallelism in host memory: without shards it has
    nothing to keep there but whole copies, which every gather would copy back."""
    if config.training.enable_cpu_offload and not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "training.enable_cpu_offload: needs sharded data parallelism (a data-parallel shard degree above 1, "
            f"got {parallel_dims.dp_shard})"
        )


def _log_offload(config: JobConfig) -> None:
    if config.training.enable_cpu_offload:
        pinned = "pinned, copied without blocking" if pinned_memory_available() else "not pinned: no accelerator"
        logger.info("CPU offload: sharded weights, gradients and optimizer state in host memory (%s)", pinned)


def _apply_fsdp2(model: nn.Module, parallel_dims: ParallelDims, config: JobConfig) -> None:
    _log_offload(config)
    param_dtype = getattr(torch, config.training.mixed_precision_param)
    reduce_dtype = getattr(torch, config.training.mixed_precision_reduce)
    dp_mesh = parallel_dims.dp_param_mesh
    if parallel_dims.fsdp_enabled:
        apply_fsdp2(
            model,
            dp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=_reshard_after_forward(parallel_dims, config),
            blocks=list(model.layers.values()),
            # torchtitan's "always" reshards every block; by default the last stays gathered.
            reshard_last_block=config.parallelism.fsdp_reshard_after_forward == "always",
            cpu_offload=config.training.enable_cpu_offload,
            forward_prefetch=config.parallelism.fsdp_forward_prefetch,
            backward_prefetch=config.parallelism.fsdp_backward_prefetch,
        )
    else:
        # DDP leaves the parameters in their dtype: autocast casts the forward (models/builder.py).
        apply_ddp(model, dp_mesh, param_dtype=getattr(torch, config.training.dtype), reduce_dtype=reduce_dtype)


def _apply_simple_fsdp(model: nn.Module, parallel_dims: ParallelDims, config: JobConfig) -> None:
    _log_offload(config)
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        mode = "replicate"
    else:
        mode = "hybrid_shard" if parallel_dims.dp_replicate_enabled else "fully_shard"
    apply_simple_fsdp(
        model,
        parallel_dims.dp_param_mesh,
        mode=mode,
        param_dtype=getattr(torch, config.training.mixed_precision_param),
        reduce_dtype=getattr(torch, config.training.mixed_precision_reduce),
        reshard_after_forward=_reshard_after_forward(parallel_dims, config),
        blocks=list(model.layers.values()),
        compiled=config.compile.compiles_model,
        cpu_offload=config.training.enable_cpu_offload,
    )


def plan_units(model: nn.Module, *, tokens: int, param_dtype: torch.dtype) -> list[PlanUnit]:
    """The model's bucketing units in forward order, with gathered bytes and matmul FLOPs for
    ``tokens`` tokens per microbatch."""
    args = model.args
    units = []
    for name, module in [
        ("tok_embeddings", model.tok_embeddings),
        *((f"layers.{i}", b) for i, b in model.layers.items()),
        ("norm", model.norm),
        ("output", model.output),
    ]:
        if module is None:
            continue
        numel = sum(p.numel() for p in module.parameters())
        forward = _forward_flops(name, numel, tokens, args)
        # Backward re-gathers only the blocks' weights: the embedding's backward needs none, and
        # SimpleFSDP keeps the final norm and output gathered (apply_simple_fsdp's ``blocks``).
        regathered = name.startswith("layers.")
        units.append(PlanUnit(name, numel * param_dtype.itemsize, forward, 2.0 * forward, regathered))
    return units


def _forward_flops(name: str, numel: int, tokens: int, args: TransformerModelArgs) -> float:
    """Matmul FLOPs of a unit's forward over ``tokens`` tokens (blocks add attention's)."""
    forward = 0.0 if name in ("tok_embeddings", "norm") else 2.0 * numel * tokens
    if name.startswith("layers."):
        forward += 4.0 * tokens * args.max_seq_len * args.dim
    return forward


def fresh_block(
    args: TransformerModelArgs, batch: int, device: torch.device, dtype: torch.dtype
) -> tuple[TransformerBlock, tuple[torch.Tensor, torch.Tensor], float]:
    """A block built from ``args`` alone in ``dtype``, its attention as the model's runs on ``device``,
    with inputs of ``batch`` sequences and the FLOPs of its forward and backward on them."""
    with torch.device("meta"):
        block = TransformerBlock(args)
    block = block.to_empty(device=device).to(dtype)
    block.attention.attention_dtype = attention_dtype(device.type, dtype, args.head_dim)  # as builder sets it
    block.attention.query_chunk = causal_query_chunk(device.type, args.max_seq_len)
    # A generator of its own: the values do not matter, and the run's random state stays as it was.
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    x = torch.randn(batch, args.max_seq_len, args.dim, device=device, dtype=dtype, generator=generator)
    x.requires_grad_()
    rope_cache = precompute_rope_cache(args, device)
    forward = _forward_flops("layers.0", sum(p.numel() for p in block.parameters()), batch * args.max_seq_len, args)
    return block, (x, rope_cache), 3.0 * forward  # backward = 2 x forward


def block_rate(args: TransformerModelArgs, batch: int, device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a fresh block's forward and backward in ``dtype`` at ``batch`` sequences. A pipeline
    stage without blocks times one too: its bucket plan weighs the others' compute against its gathers."""
    return measure_rate(*fresh_block(args, batch, device, dtype))


def _cost_models(
    args: TransformerModelArgs, parallel_dims: ParallelDims, config: JobConfig, dtype: torch.dtype
) -> tuple[CommModel, ComputeModel]:
    """Auto bucketing's link and compute models: configured, or measured on every rank."""
    device = torch.device(parallel_dims.mesh.device_type)
    if config.comm.alpha_us is not None and config.comm.bandwidth_gbps is not None:
        comm = CommModel.from_config(config.comm.alpha_us, config.comm.bandwidth_gbps)
    else:
        comm = calibrate_comm_model(parallel_dims.dp_mesh.get_group(), device=device)
        logger.info(
            "calibrated collectives: alpha %.1f us, bandwidth %.3f GB/s",
            comm.alpha_s * 1e6,
            comm.bandwidth_bytes_per_s / 1e9,
        )
    compute = ComputeModel.from_config(
        config.compile.compute_flops,
        lambda: block_rate(args, config.training.local_batch_size, device, dtype),
    )
    # Every rank must merge the same collectives: plan with the slowest rank's measured rate.
    rate = torch.tensor(compute.flops_per_second, dtype=torch.float64, device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    source = "compile.compute_flops" if config.compile.compute_flops is not None else "one block timed, slowest rank"
    logger.info("auto bucketing prices compute at %.3g FLOP/s (%s)", rate.item(), source)
    return comm, ComputeModel(rate.item())


def bucket_plan(
    model: nn.Module, parallel_dims: ParallelDims, config: JobConfig, saved_plans: str | None = None
) -> BucketPlan | None:
    """SimpleFSDP's bucket plan for ``model``, None when there is nothing to bucket. Auto bucketing
    reuses the plan an earlier start saved in ``saved_plans``."""
    if config.compile.bucketing == "none" or not parallel_dims.dp_enabled:
        return None
    param_dtype = getattr(torch, config.training.mixed_precision_param)
    units = plan_units(
        model, tokens=config.training.local_batch_size * config.training.seq_len, param_dtype=param_dtype
    )
    if config.compile.bucketing in ("manual", "block"):  # block: a bucket per block bounds its halves
        patterns = config.compile.manual_buckets if config.compile.bucketing == "manual" else []
        with user_input("compile.manual_buckets"):
            return plan_manual(units, patterns or default_manual_patterns([u.name for u in units]))

    dp_group = parallel_dims.dp_mesh.get_group()
    memory_cap_bytes = int(config.compile.bucket_memory_cap_mb * 2**20)
    reduce_factor = getattr(torch, config.training.mixed_precision_reduce).itemsize / param_dtype.itemsize
    reshard = _reshard_after_forward(parallel_dims, config)

    def make_plan() -> BucketPlan:
        comm, compute = _cost_models(model.args, parallel_dims, config, param_dtype)
        return plan_auto(
            units,
            comm,
            compute,
            world_size=parallel_dims.dp_degree,
            memory_cap_bytes=memory_cap_bytes,
            reduce_scatter_bytes_factor=reduce_factor,
            reshard_after_forward=reshard,
        )

    key = {
        "units": [dataclasses.astuple(unit) for unit in units],
        "world_size": parallel_dims.dp_degree,
        "memory_cap_bytes": memory_cap_bytes,
        "reduce_factor": reduce_factor,
        "reshard_after_forward": reshard,
        "comm": [config.comm.alpha_us, config.comm.bandwidth_gbps, config.compile.compute_flops],
    }
    plan, path = saved_or_new_plan(saved_plans, key, make_plan, dp_group)
    if path is not None:
        logger.info("SimpleFSDP auto buckets as planned at an earlier start (%s)", path)
    return plan


def check_llama_layout(model_args: TransformerModelArgs, parallel_dims: ParallelDims, config: JobConfig) -> None:
    """Raises the ConfigError ``parallelize_llama`` or ``pipeline_llama`` would raise, on the meta device."""
    with user_input("model"):
        check_args(model_args)
    _check_tied(model_args, parallel_dims)
    check_offload(parallel_dims, config)
    if "float8" in config.model.converters:
        with as_options(FLOAT8_OPTIONS, "model.converters"):
            check_float8(device_type(), config.float8.emulate)
        with torch.device("meta"), user_input("float8.filter_fqns"):
            check_filter_fqns(Transformer(model_args), config.float8.filter_fqns)
    if parallel_dims.tp_enabled:
        with torch.device("meta"), as_options(TP_OPTIONS):
            validate_tp(Transformer(model_args), parallel_dims.tp)
        _async_tp(config, device_type())
    if parallel_dims.pp_enabled:
        pipeline_layout(config, model_args.n_layers)
        check_schedule_runs_here(config.parallelism.pipeline_parallel_schedule)
    ac = config.activation_checkpoint
    if (
        ac.mode == "selective"
        and ac.selective_ac_option.isdecimal()
        and int(ac.selective_ac_option) > model_args.n_layers
    ):
        logger.warning(
            "activation_checkpoint.selective_ac_option %s is more than the model's %d blocks: no block is checkpointed",
            ac.selective_ac_option,
            model_args.n_layers,
        )
    # Manual bucket specs against the model's modules (a pipeline stage checks its own when built).
    c = config.compile
    simple_fsdp = config.parallelism.data_parallel_impl == "simple_fsdp" and parallel_dims.dp_enabled
    if (
        c.compiles_model
        and c.bucketing == "manual"
        and c.manual_buckets
        and simple_fsdp
        and not parallel_dims.pp_enabled
    ):
        with torch.device("meta"):
            units = plan_units(Transformer(model_args), tokens=1, param_dtype=torch.float32)
        with user_input("compile.manual_buckets"):
            plan_manual(units, c.manual_buckets)


def _check_tied(model_args: TransformerModelArgs, parallel_dims: ParallelDims) -> None:
    """A tied table is one parameter used by the first and the last layer: it cannot be split by
    tensor parallelism (vocabulary-sharded twice) nor live on two pipeline stages."""
    if model_args.tie_word_embeddings and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        raise ConfigError(
            f"model.tie_word_embeddings: a tied embedding table does not work with tensor parallelism "
            f"(degree {parallel_dims.tp}) or pipeline parallelism (degree {parallel_dims.pp}); "
            "--model.tie_word_embeddings false trains an untied copy"
        )
