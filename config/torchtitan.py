"""torchtitan v0.2.2's option names, so that its TOML files and command lines load unchanged: options Tessera
has under another name (``ALIASES``, ``NEGATED``), and options of features it lacks (``FOREIGN``), each with the
value that leaves the feature off; at another value, it asks for the missing feature."""

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
"""Aliases that win over their option rather than contradict it: ``dataset_path`` holds the named dataset's files."""

VALUE_ALIASES = {"model.converters": {"quantize.linear.float8": "float8"}}
"""Option -> torchtitan's name of one of its values -> Tessera's (a list's items each)."""

NEGATED = {"parallelism.disable_loss_parallel": "parallelism.enable_loss_parallel"}
"""torchtitan boolean -> the Tessera boolean meaning its opposite."""

ANY = object()  # any value leaves the feature off, or only tunes how a missing feature would run

# Tessera recognises a Hugging Face folder by itself (initial_load_in_hf); its last checkpoint holds everything.
_ANY_VALUE = """metrics.disable_color_printing training.dataloader.persistent_workers training.dataloader.pin_memory
    training.dataloader.prefetch_factor parallelism.pipeline_parallel_expert_parallel_overlap
    parallelism.context_parallel_load_balancer
    parallelism.expert_parallel_comm_backend checkpoint.enable_ft_dataloader_checkpoints
    checkpoint.initial_load_in_hf checkpoint.last_save_model_only
    activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns
    quantize.linear.mx.mxfp8_dim1_cast_kernel_choice quantize.linear.mx.recipe_name quantize.linear.mx.filter_fqns
    quantize.grouped_mm.float8.fqns quantize.grouped_mm.mx.recipe_name quantize.grouped_mm.mx.fqns
    memory_estimation.disable_fake_mode validation.dataloader.num_workers validation.dataloader.persistent_workers
    validation.dataloader.pin_memory validation.dataloader.prefetch_factor"""

FOREIGN: dict[str, object] = {
    "job.custom_config_module": "",
    "parallelism.expert_parallel_degree": 1,
    "parallelism.expert_tensor_parallel_degree": 1,
    "checkpoint.initial_load_in_hf_quantized": False,
    "activation_checkpoint.visualize_memory_budget_pareto": False,
    "comm.mode": "default",
    "experimental.custom_import": "",
    "experimental.custom_args_module": "",
    "debug.moe_force_load_balance": False,
    **dict.fromkeys(_ANY_VALUE.split(), ANY),
}
"""torchtitan options of features Tessera lacks -> the value that leaves the feature off."""

_NO_USER_CODE = " (Tessera imports no module of yours: what it would register or configure is not there)"
CHANGES_THE_RUN = {
    "parallelism.expert_parallel_degree": "",
    "comm.mode": "; a dry run is COMM_MODE=fake ./run_train.sh",
    "checkpoint.initial_load_in_hf_quantized": " (the quantized Hugging Face weights would load as plain ones)",
    "job.custom_config_module": _NO_USER_CODE,
    "experimental.custom_import": _NO_USER_CODE,
    "experimental.custom_args_module": _NO_USER_CODE,
}
"""Missing features a run cannot go without (how ranks split the work, or whether they train) -> what instead."""
