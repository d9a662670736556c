"""torchtitan v0.2.2's option names, so that its TOML files and command lines load unchanged.

Three kinds of names: options Tessera has under another name (``ALIASES``, ``NEGATED``), and
options of features Tessera does not have (``FOREIGN``), each with the value that leaves the
feature off. A foreign option at that value changes nothing; at another value it asks for the
missing feature.
"""

from __future__ import annotations

ALIASES = {
    "model.hf_assets_path": "model.tokenizer_path",
    "training.dataset_path": "training.dataset",
    "validation.dataset_path": "validation.dataset",
    "training.gc_freq": "debug.gc_freq",
    "training.gc_debug": "debug.gc_debug",
    "training.dataloader.num_workers": "training.dataloader_num_workers",
    "checkpoint.last_save_in_hf": "checkpoint.export_hf",
    "quantize.linear.float8.recipe_name": "float8.recipe_name",
    "quantize.linear.float8.enable_fsdp_float8_all_gather": "float8.enable_fsdp_float8_all_gather",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": "float8.precompute_float8_dynamic_scale_for_fsdp",
    "quantize.linear.float8.filter_fqns": "float8.filter_fqns",
    "quantize.linear.float8.emulate": "float8.emulate",
}
"""torchtitan name -> the Tessera option it sets."""

OVERRIDING = {"training.dataset_path", "validation.dataset_path"}
"""Aliases that, given beside the option, win over it rather than contradict it: torchtitan's
``dataset_path`` is where the files of the dataset its ``dataset`` names are."""

NEGATED = {"parallelism.disable_loss_parallel": "parallelism.enable_loss_parallel"}
"""torchtitan boolean -> the Tessera boolean meaning its opposite."""

ANY = object()
"""Any value leaves the feature off (or only tunes how a missing feature would run)."""

FOREIGN: dict[str, object] = {
    "job.custom_config_module": "",
    "metrics.disable_color_printing": ANY,
    "training.enable_cpu_offload": False,
    "training.dataloader.persistent_workers": ANY,
    "training.dataloader.pin_memory": ANY,
    "training.dataloader.prefetch_factor": ANY,
    "parallelism.pipeline_parallel_schedule_csv": "",
    "parallelism.pipeline_parallel_expert_parallel_overlap": ANY,
    "parallelism.context_parallel_degree": 1,
    "parallelism.context_parallel_load_balancer": ANY,
    "parallelism.context_parallel_rotate_method": ANY,
    "parallelism.expert_parallel_degree": 1,
    "parallelism.expert_tensor_parallel_degree": 1,
    "parallelism.expert_parallel_comm_backend": ANY,
    "checkpoint.enable_ft_dataloader_checkpoints": ANY,
    "checkpoint.initial_load_in_hf": ANY,  # Tessera recognises a Hugging Face folder by itself
    "checkpoint.initial_load_in_hf_quantized": False,
    "checkpoint.last_save_model_only": ANY,  # Tessera's last checkpoint holds everything
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": ANY,
    "activation_checkpoint.visualize_memory_budget_pareto": False,
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": ANY,
    "quantize.linear.mx.recipe_name": ANY,
    "quantize.linear.mx.filter_fqns": ANY,
    "quantize.grouped_mm.float8.fqns": ANY,
    "quantize.grouped_mm.mx.recipe_name": ANY,
    "quantize.grouped_mm.mx.fqns": ANY,
    "comm.mode": "default",
    "memory_estimation.enable": False,
    "memory_estimation.disable_fake_mode": ANY,
    "fault_tolerance.enable": False,
    "fault_tolerance.process_group": ANY,
    "fault_tolerance.process_group_timeout_ms": ANY,
    "fault_tolerance.replica_id": ANY,
    "fault_tolerance.group_size": ANY,
    "fault_tolerance.min_replica_size": ANY,
    "fault_tolerance.semi_sync_method": ANY,
    "experimental.custom_import": "",
    "experimental.custom_args_module": "",
    "validation.dataloader.num_workers": ANY,
    "validation.dataloader.persistent_workers": ANY,
    "validation.dataloader.pin_memory": ANY,
    "validation.dataloader.prefetch_factor": ANY,
    "debug.moe_force_load_balance": False,
}
"""torchtitan options of features Tessera lacks -> the value that leaves the feature off."""

CHANGES_THE_RUN = {
    "parallelism.context_parallel_degree": "",
    "parallelism.expert_parallel_degree": "",
    "comm.mode": "; a dry run is COMM_MODE=fake ./run_train.sh",
}
"""Missing features a run cannot go without (they change how ranks split the work, or whether
they train at all) -> what to use instead, if anything."""


def asks_for_feature(key: str, value: object) -> bool:
    """Whether setting the foreign option ``key`` to ``value`` asks for a feature Tessera lacks."""
    neutral = FOREIGN[key]
    return neutral is not ANY and value != neutral
