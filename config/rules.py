"""The job config's rule book: value ranges, options that contradict each other, options without effect."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing

from config.errors import ConfigError
from config.evaluation import check_evaluation
from config.fault_tolerance import check_fault_tolerance
from config.job_config import (
    CHECKPOINT_PARTS,
    DEFAULT_TOKENIZER_MIN_VOCAB,
    MODEL_SIZE_FIELDS,
    Float8,
    JobConfig,
    Parallelism,
    Training,
    Validation,
)

logger = logging.getLogger(__name__)

_MODEL_SIZES = " ".join(f"model.{n}" for n in MODEL_SIZE_FIELDS if n not in ("use_rope_scaling", "tie_word_embeddings"))

_IN_RANGE: dict[str, typing.Callable[[float], bool]] = {
    "positive": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "-1 or positive": lambda v: v == -1 or v > 0,
    "-1 or >= 0": lambda v: v >= -1,
}
# Range -> the options that must be in it when set (validation's only when enabled: torchtitan's files leave it -1).
RANGES = {
    "positive": f"""training.seq_len training.local_batch_size training.steps metrics.log_freq metrics.peak_flops
        profiling.profile_freq profiling.profiler_active comm.init_timeout_seconds comm.train_timeout_seconds
        comm.bandwidth_gbps checkpoint.interval compile.compute_flops compile.bucket_memory_cap_mb
        parallelism.data_parallel_replicate_degree parallelism.tensor_parallel_degree
        parallelism.pipeline_parallel_degree parallelism.context_parallel_degree validation.freq validation.steps validation.local_batch_size
        validation.seq_len {_MODEL_SIZES}""",
    ">= 0": """training.max_norm training.dataloader_num_workers training.dataset_prepare_workers profiling.profiler_warmup debug.gc_freq
        comm.trace_buf_size comm.alpha_us comm.hang_timeout_seconds metrics.straggler_threshold checkpoint.keep_latest_k lr_scheduler.warmup_steps
        parallelism.pipeline_parallel_first_stage_less_layers parallelism.pipeline_parallel_last_stage_less_layers""",
    "in [0, 1]": "lr_scheduler.decay_ratio activation_checkpoint.memory_budget",
    "-1 or positive": """training.global_batch_size parallelism.data_parallel_shard_degree parallelism.fsdp_forward_prefetch
        parallelism.fsdp_backward_prefetch""",
    "-1 or >= 0": "checkpoint.load_step",
}


def _check_ranges(c: JobConfig) -> None:
    for allowed, keys in RANGES.items():
        for key in keys.split():
            section, _, name = key.partition(".")
            value = getattr(getattr(c, section), name)
            if value is not None and (c.validation.enable or not key.startswith("validation.")):
                if not _IN_RANGE[allowed](value):
                    raise ConfigError(f"{key} must be {allowed}, got {value}")


# (a mistake, what to say: formatted with the config as c), in the order they are looked for.
# fmt: off
_CONTRADICTIONS: list[tuple[typing.Callable[[JobConfig], typing.Any], str]] = [
    (lambda c: c.profiling.profiler_active > c.profiling.profile_freq,
     "profiling.profiler_active {c.profiling.profiler_active} is more steps than a window of "
     "profiling.profile_freq {c.profiling.profile_freq}"),
    (lambda c: c.training.dtype == "bfloat16" and c.training.mixed_precision_param == "float32",
     "training.mixed_precision_param: float32 compute of the bfloat16 weights of training.dtype bfloat16; "
     "leave it auto or set bfloat16"),
    (lambda c: c.model.default_tokenizer_vocab_size < DEFAULT_TOKENIZER_MIN_VOCAB and not c.model.tokenizer_path,
     f"model.default_tokenizer_vocab_size must be at least {DEFAULT_TOKENIZER_MIN_VOCAB} (the default corpus's "
     "characters), got {c.model.default_tokenizer_vocab_size}"),
    # Llama 3.1's RoPE divides by high - low.
    (lambda c: None not in (lo := c.model.rope_low_freq_factor, hi := c.model.rope_high_freq_factor) and lo >= hi,
     "model.rope_low_freq_factor {c.model.rope_low_freq_factor} is not below model.rope_high_freq_factor "
     "{c.model.rope_high_freq_factor}"),
    (lambda c: c.training.dataset_weights and len(c.training.dataset_weights) != len(c.training.datasets),
     "training.dataset_weights: {c.training.dataset_weights} is not one weight per corpus of training.datasets "
     "{c.training.datasets}"),
    (lambda c: any(not w > 0 for w in c.training.dataset_weights),
     "training.dataset_weights must be positive, got {c.training.dataset_weights}"),
    (lambda c: c.training.dataset_format == "chat" and not c.model.tokenizer_path,
     "training.dataset_format chat renders conversations with a tokenizer folder's chat_template: give the "
     "Hugging Face folder as model.tokenizer_path"),
    # ' ' would be a folder of that name in the working folder.
    (lambda c: not c.job.dump_folder.strip(), "job.dump_folder: no folder given ('.' is the working folder)"),
    (lambda c: (name := c.job.run_name) and (not name.strip() or name in (".", "..") or os.sep in name),
     f"job.run_name: {{c.job.run_name!r}} is not a plain folder name (not blank, no '{os.sep}', not '.' or "
     "'..'); the run's TensorBoard folder goes inside job.dump_folder"),
    (lambda c: c.compile.enable and not c.compile.components,
     "compile.components: empty, so compile.enable would compile nothing; name model and/or loss"),
    # Loss parallel's cross-entropy runs eagerly on the vocabulary-sharded logits.
    (lambda c: c.compile.enable and set(c.compile.components) == {"loss"} and c.parallelism.tensor_parallel_degree > 1,
     "compile.components: the loss alone, which tensor parallelism runs eagerly, so compile.enable "
     "would compile nothing; add model"),
    # The flight recorder's file would be in no folder made.
    (lambda c: os.sep in c.comm.save_traces_file_prefix,
     f"comm.save_traces_file_prefix: {{c.comm.save_traces_file_prefix!r}} holds a '{os.sep}'; it begins the "
     "file names in comm.save_traces_folder, which names the folder"),
    # At 1 or below, a rank as busy as its peers would be named.
    (lambda c: 0 < c.metrics.straggler_threshold <= 1,
     "metrics.straggler_threshold must be 0 (off) or above 1 (a ratio to the peers' median), got "
     "{c.metrics.straggler_threshold}"),
    (lambda c: (c.comm.alpha_us is None) != (c.comm.bandwidth_gbps is None),
     "comm.alpha_us and comm.bandwidth_gbps go together: set both or neither (calibrate)"),
    # The schedule runs several microbatches' backwards within one call: no step can wait for the last.
    (lambda c: c.optimizer.early_step_in_backward and c.parallelism.pipeline_parallel_degree > 1,
     "optimizer.early_step_in_backward: not with pipeline parallelism (pipeline_parallel_degree > 1)"),
    (lambda c: c.parallelism.pipeline_parallel_degree > 1 and not c.parallelism.pipeline_parallel_schedule_csv
     and c.parallelism.pipeline_parallel_schedule.startswith("PipelineSchedule"),
     "parallelism.pipeline_parallel_schedule {c.parallelism.pipeline_parallel_schedule} runs the order that "
     "parallelism.pipeline_parallel_schedule_csv gives; give that CSV file, or name a built-in schedule"),
    (lambda c: c.optimizer.early_step_in_backward and c.training.nonfinite_policy == "skip_step",
     "training.nonfinite_policy skip_step: the update it would skip has happened in backward under "
     "optimizer.early_step_in_backward; use error or rollback"),
    (lambda c: c.optimizer.early_step_in_backward and c.debug.failure == "nan" and c.debug.fail_at_step >= 0,
     "debug.failure nan: it poisons the gradients before the update, which "
     "optimizer.early_step_in_backward makes in backward"),
    # torchtitan's files carry [quantize.linear.float8] whether or not model.converters asks for it.
    (lambda c: _float8(c) and c.float8.enable_fsdp_float8_all_gather and c.float8.recipe_name != "tensorwise",
     "float8.enable_fsdp_float8_all_gather: a gather casts with one scale per weight (recipe_name "
     "tensorwise), not with float8.recipe_name {c.float8.recipe_name}"),
    (lambda c: _float8(c) and c.float8.enable_fsdp_float8_all_gather and c.parallelism.data_parallel_impl != "fsdp2",
     "float8.enable_fsdp_float8_all_gather: FSDP2's (parallelism.data_parallel_impl fsdp2); "
     "{c.parallelism.data_parallel_impl} gathers the weights in the compute dtype"),
    (lambda c: _float8(c) and "auto_filter_small_kn" in c.float8.filter_fqns
     and c.float8.recipe_name == "rowwise_with_gw_hp",
     "float8.filter_fqns: torchao's auto_filter_small_kn has thresholds for the tensorwise and rowwise "
     "recipes, not for float8.recipe_name rowwise_with_gw_hp"),
    (lambda c: c.activation_checkpoint.mode == "selective" and not _every_nth_block(c.activation_checkpoint.selective_ac_option),
     "activation_checkpoint.selective_ac_option: '{c.activation_checkpoint.selective_ac_option}' "
     "is neither 'op' nor a positive integer"),
    (lambda c: c.activation_checkpoint.mode == "memory_budget" and not c.compile.compiles_model,
     "activation_checkpoint.mode memory_budget: the compiler picks what to recompute; set compile.enable"),
    # torch's checkpoint refuses debug beside a selective policy, which compile also gives it.
    (lambda c: (ac := c.activation_checkpoint).debug and ac.mode in ("full", "selective")
     and (c.compile.compiles_model or (ac.mode == "selective" and ac.selective_ac_option == "op")),
     "activation_checkpoint.debug: torch records a checkpoint's ops only eagerly and without "
     "an op-level policy (not with compile.enable or selective_ac_option op)"),
    (lambda c: c.validation.enable and (c.validation.seq_len or 0) > c.training.seq_len,
     "validation.seq_len {c.validation.seq_len} exceeds training.seq_len {c.training.seq_len}, "
     "the longest the model's rotary table holds"),
    (lambda c: c.validation.enable and (c.validation.seq_len or 0) % c.parallelism.tensor_parallel_degree,
     "validation.seq_len {c.validation.seq_len}: parallelism.tensor_parallel_degree "
     "{c.parallelism.tensor_parallel_degree} must divide it (sequence parallel)"),
    *((lambda c, name=name: c.validation.enable and c.parallelism.pipeline_parallel_degree > 1
       and getattr(c.validation, name) not in (None, getattr(c.training, name)),
       f"validation.{name}: a pipeline validates with training's microbatches; "
       f"leave it unset or at training.{name} {{c.training.{name}}}")
      for name in ("local_batch_size", "seq_len")),
    # Context parallelism: each rank holds 2 of 2 x degree equal chunks (head and tail), which
    # sequence parallel splits again.
    *((lambda c, name=name: c.parallelism.context_parallel_degree > 1
       and _cp_seq_len(c, name) % (2 * c.parallelism.context_parallel_degree),
       f"{name}.seq_len {{c.{name}.seq_len}} does not split into 2 x parallelism.context_parallel_degree "
       "{c.parallelism.context_parallel_degree} equal chunks (each context-parallel rank holds two)")
      for name in ("training", "validation")),
    *((lambda c, name=name: c.parallelism.context_parallel_degree > 1
       and (_cp_seq_len(c, name) // c.parallelism.context_parallel_degree) % c.parallelism.tensor_parallel_degree,
       f"{name}.seq_len {{c.{name}.seq_len}}: parallelism.context_parallel_degree "
       "{c.parallelism.context_parallel_degree} x tensor_parallel_degree {c.parallelism.tensor_parallel_degree} "
       "must divide it (sequence parallel splits each context-parallel rank's tokens)")
      for name in ("training", "validation")),
    (lambda c: set(CHECKPOINT_PARTS) <= set(c.checkpoint.exclude_from_loading),
     f"checkpoint.exclude_from_loading: every part ({', '.join(CHECKPOINT_PARTS)}), so a resume would "
     "load nothing; to start afresh, give another checkpoint.folder or job.dump_folder"),
    *((lambda c, name=name: getattr(c.checkpoint, name) not in (False, -1) and not c.checkpoint.enable,
       f"checkpoint.{name} needs checkpoint.enable")
      for name in ("create_seed_checkpoint", "load_step", "export_hf", "enable_first_step_checkpoint", "load_only")),
    *((lambda c, name=name: c.checkpoint.load_only and getattr(c.checkpoint, name),
       f"checkpoint.{name}: it saves, which checkpoint.load_only rules out")
      for name in ("create_seed_checkpoint", "export_hf", "enable_first_step_checkpoint")),
    (lambda c: c.training.nonfinite_policy == "rollback" and not c.checkpoint.enable,
     "training.nonfinite_policy: 'rollback' needs checkpoint.enable"),
    *((lambda c, name=name: getattr(c.parallelism, name) is not None and c.parallelism.data_parallel_impl == "simple_fsdp"
       and (not c.compile.compiles_model or c.compile.bucketing == "block"),
       f"parallelism.{name}: SimpleFSDP moves gathers ahead only in a compiled model's graph (compile.enable, "
       "compile.bucketing not block); eagerly each weight is gathered when read")
      for name in ("fsdp_forward_prefetch", "fsdp_backward_prefetch")),
    (lambda c: c.checkpoint.create_seed_checkpoint and c.parallelism.pipeline_parallel_degree > 1,
     "checkpoint.create_seed_checkpoint: run it on 1 rank without pipeline parallelism"),
]
# fmt: on


def _cp_seq_len(c: JobConfig, section: str) -> int:
    """The sequence length of training's or (when enabled) validation's batches; 0 when validation is off."""
    if section == "validation":
        return (c.validation.seq_len or c.training.seq_len) if c.validation.enable else 0
    return c.training.seq_len


def _float8(c: JobConfig) -> bool:
    return "float8" in c.model.converters


def _every_nth_block(option: str) -> bool:
    return option == "op" or (option.isdecimal() and int(option) >= 1)


def validate(config: JobConfig) -> None:
    """Checks what does not depend on the world size (the optimizer's and LR schedule's values: when built)."""
    _check_ranges(config)
    check_fault_tolerance(config.fault_tolerance, config.optimizer.early_step_in_backward)
    parallel = config.parallelism
    degrees = parallel.pipeline_parallel_degree, parallel.context_parallel_degree
    check_evaluation(config.eval, config.training.seq_len, *degrees)
    for mistake, message in _CONTRADICTIONS:
        if mistake(config):
            raise ConfigError(message.format(c=config))


def batch_layout(training: Training, dp_degree: int) -> tuple[int, int]:
    """(global batch size, gradient-accumulation microbatches) for ``dp_degree`` data-parallel ranks."""
    per_microbatch = training.local_batch_size * dp_degree
    global_batch = training.global_batch_size if training.global_batch_size > 0 else per_microbatch
    if global_batch % per_microbatch:
        raise ConfigError(
            f"training.global_batch_size {global_batch} is not divisible by "
            f"training.local_batch_size x data-parallel degree = {per_microbatch}"
        )
    return global_batch, global_batch // per_microbatch


def _fields(cls: type, but: str = "") -> str:
    return " ".join(f.name for f in dataclasses.fields(cls) if f.name != but)


_UNSHARDED = "no sharded data parallelism: the data-parallel shard degree is 1"
_NO_DP = "no data parallelism: one data-parallel rank"
_SIMPLE_FSDP = "bucketing manual_buckets bucket_memory_cap_mb compute_flops"
_PIPELINE = _fields(Parallelism, but="pipeline_parallel_degree").split()
_PIPELINE = " ".join(n for n in _PIPELINE if n.startswith("pipeline_parallel_")) + " module_fqns_per_model_part"
_ENDS = "pipeline_parallel_first_stage_less_layers pipeline_parallel_last_stage_less_layers"


def _no_effect_rules(c: JobConfig, dp: tuple[int, int] | None) -> list[tuple[typing.Any, str, str]]:
    """(when, why, section: options); the first that holds gives an option's reason. ``dp``: (replicate, shard)."""
    ck, comp, ac, p, m, dbg = c.checkpoint, c.compile, c.activation_checkpoint, c.parallelism, c.metrics, c.debug
    unsharded, one_dp = dp is not None and dp[1] == 1, dp is not None and dp[0] * dp[1] == 1
    ac_mode = f"activation_checkpoint.mode is {ac.mode}"
    # fmt: off
    return [
        (not ck.enable, "checkpoint.enable is false", "checkpoint: folder interval async_mode keep_latest_k export_dtype"),
        (ck.load_only, "checkpoint.load_only saves nothing", "checkpoint: interval async_mode keep_latest_k"),
        (not ck.export_hf, "checkpoint.export_hf is false", "checkpoint: export_dtype"),
        (not ck.initial_load_path, "no checkpoint.initial_load_path", "checkpoint: initial_load_model_only"),
        (not ck.enable and (not ck.initial_load_path or ck.initial_load_model_only), "nothing loads but model weights",
         "checkpoint: exclude_from_loading"),
        (not comp.enable, "compile.enable is false", f"compile: components backend {_SIMPLE_FSDP}"),
        # SimpleFSDP's buckets are made in the model's graph.
        (not comp.compiles_model, "compile.components has no model", f"compile: {_SIMPLE_FSDP}"),
        (p.data_parallel_impl != "simple_fsdp", f"parallelism.data_parallel_impl is {p.data_parallel_impl}",
         f"compile: {_SIMPLE_FSDP}"),
        (comp.bucketing != "manual", f"compile.bucketing is {comp.bucketing}", "compile: manual_buckets"),
        (comp.bucketing != "auto", f"compile.bucketing is {comp.bucketing}", "compile: bucket_memory_cap_mb compute_flops"),
        ("float8" not in c.model.converters, "model.converters has no float8", f"float8: {_fields(Float8)}"),
        (not c.float8.enable_fsdp_float8_all_gather, "float8.enable_fsdp_float8_all_gather is false",
         "float8: precompute_float8_dynamic_scale_for_fsdp"),
        (ac.mode != "selective", ac_mode, "activation_checkpoint: selective_ac_option"),
        (ac.mode != "memory_budget", ac_mode, "activation_checkpoint: memory_budget"),
        # No block is wrapped in torch's checkpoint.
        (ac.mode in ("none", "memory_budget"), ac_mode,
         "activation_checkpoint: early_stop preserve_rng_state determinism_check debug"),
        (p.pipeline_parallel_degree == 1, "no pipeline parallelism", f"parallelism: {_PIPELINE}"),
        (p.pipeline_parallel_split_points, "parallelism.pipeline_parallel_split_points gives the stages",
         f"parallelism: {_ENDS}"),
        (p.module_fqns_per_model_part, "parallelism.module_fqns_per_model_part gives the stages", f"parallelism: {_ENDS}"),
        (p.context_parallel_degree == 1, "no context parallelism", "parallelism: context_parallel_rotate_method"),
        (p.tensor_parallel_degree == 1, "no tensor parallelism",
         "parallelism: enable_loss_parallel enable_async_tensor_parallel"),
        (not c.validation.enable, "validation.enable is false", f"validation: {_fields(Validation, but='enable')}"),
        (not c.profiling.enable_profiling, "profiling.enable_profiling is false",
         "profiling: save_traces_folder profile_freq profiler_active profiler_warmup"),
        (not c.profiling.enable_memory_snapshot, "profiling.enable_memory_snapshot is false",
         "profiling: save_memory_snapshot_folder"),
        (not m.enable_tensorboard, "metrics.enable_tensorboard is false", "metrics: save_tb_folder"),
        (not m.enable_tensorboard and not m.enable_wandb, "metrics.enable_tensorboard and metrics.enable_wandb are false",
         "metrics: save_for_all_ranks"),
        (not dbg.deterministic, "debug.deterministic is false", "debug: deterministic_warn_only"),
        (dbg.fail_at_step < 0, "debug.fail_at_step is -1", "debug: failure"),
        (dbg.failure.endswith("_during_save") and not ck.enable,
         f"debug.failure {dbg.failure} without checkpoint.enable", "debug: fail_at_step failure"),
        (unsharded, _UNSHARDED, "parallelism: fsdp_reshard_after_forward fsdp_forward_prefetch fsdp_backward_prefetch"),
        (unsharded, _UNSHARDED, "float8: enable_fsdp_float8_all_gather precompute_float8_dynamic_scale_for_fsdp"),
        # Without data parallelism SimpleFSDP compiles the whole model without buckets, whatever the plan.
        (one_dp, _NO_DP, "training: mixed_precision_reduce"),
        (one_dp, _NO_DP, "compile: manual_buckets bucket_memory_cap_mb compute_flops"),
        (one_dp and comp.bucketing != "block", _NO_DP, "compile: bucketing"),
    ]
    # fmt: on


def _no_effect(c: JobConfig, dp: tuple[int, int] | None = None) -> dict[str, str]:
    """option: why it does nothing in this run."""
    reasons: dict[str, str] = {}
    for holds, why, options in _no_effect_rules(c, dp):
        section, _, names = options.partition(": ")
        for name in names.split() if holds else ():
            reasons.setdefault(f"{section}.{name}", why)
    return reasons


def _warn_ignored(reasons: dict[str, str], typed: typing.AbstractSet[str]) -> None:
    if ignored := [f"--{key} ({reasons[key]})" for key in sorted(typed & reasons.keys())]:
        logger.warning("no effect in this run: %s", "; ".join(ignored))


def warn_no_effect_at_degrees(
    config: JobConfig, typed: typing.AbstractSet[str], dp_replicate: int, dp_shard: int
) -> None:
    """One warning line for the options in ``typed`` that do nothing at these data-parallel degrees alone."""
    before = _no_effect(config)
    after = _no_effect(config, (dp_replicate, dp_shard))
    _warn_ignored({key: why for key, why in after.items() if key not in before}, typed)


def warn_no_effect(config: JobConfig, typed: typing.AbstractSet[str]) -> None:
    """One warning line for the typed options this run ignores (torchtitan's files set many), and for windows longer
    than the run or an LR schedule shorter than it."""
    _warn_ignored(_no_effect(config), typed)
    ck = config.checkpoint
    if ck.enable and not ck.export_hf and ck.export_dtype != "float32" and "checkpoint.export_dtype" not in typed:
        # torchtitan would save its last checkpoint model-only in this dtype; Tessera's is whole.
        logger.warning(
            "checkpoint.export_dtype %s is the dtype of the Hugging Face export alone (checkpoint.export_hf), "
            "which is off: the last checkpoint is saved whole, as trained",
            ck.export_dtype,
        )
    steps = config.training.steps
    windows = {
        "validation.freq": (config.validation.enable, config.validation.freq, "only validation after step 1"),
        "profiling.profile_freq": (config.profiling.enable_profiling, config.profiling.profile_freq, "no trace"),
        "debug.fail_at_step": (config.debug.fail_at_step >= 0, config.debug.fail_at_step, "no injected failure"),
    }
    for key, (enabled, freq, what) in windows.items():
        if enabled and freq > steps:
            logger.warning("%s %d is more than training.steps %d: %s in this run", key, freq, steps, what)
    schedule = config.lr_scheduler.total_steps
    if schedule is not None and schedule < steps:
        logger.warning(
            "lr_scheduler.total_steps %d is less than training.steps %d: steps %d to %d train at the final "
            "learning rate",
            *(schedule, steps, schedule + 1, steps),
        )
