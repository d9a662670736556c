"""torchtitan v0.2.2's Llama 3 integration-test flag lists (its tests/integration_tests/features.py and
ft.py), written here as data: each list's name, its runs (one flag list per run_train.sh launch, in
the same dump folder), its ranks, and what Tessera does with it on CPU ranks with torchtitan's debug
config: "trains" or "refused: <what the one line says>"."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from tests.launch import REPO

ANCHOR = os.path.join(os.path.dirname(REPO), "shared", "anchors", "torchtitan-v0.2.2")
DEBUG_CONFIG = os.path.join(ANCHOR, "train_configs", "debug_model.toml")
TOKENIZER = os.path.join(ANCHOR, "assets", "tokenizer")
# Every run: torchtitan's test tokenizer, a corpus Tessera has without a download, and the debug config
# at sequences of 256 (of its 2048) and 2 steps (of its 10), so that every list trains in minutes on 2 cores.
COMMON = ["--model.hf_assets_path", TOKENIZER, "--training.dataset", "python_docs", "--training.seq_len", "256"]
STEPS_SCALE = 5  # torchtitan's steps -> Tessera's: its 10 and 20 (a resume) are 2 and 4 here
# ft.py launches every run as replica group 0 of torchft, with a lighthouse at TORCHFT_LIGHTHOUSE.
FT = ["--fault_tolerance.enable", "--fault_tolerance.replica_id=0", "--fault_tolerance.group_size=8"]
# features.py's path of the first run's Hugging Face export; here the export of that run's checkpoint folder.
HF_EXPORT = "{dump}/hf_checkpoint/hf"


@dataclass(frozen=True)
class FlagList:
    name: str
    runs: tuple[tuple[str, ...], ...]
    ranks: int
    expect: str = "trains"

    def argv(self, run: int, dump: str) -> list[str]:
        """The run's options after COMMON: two steps unless the list gives its own (scaled), its flags
        split as torchtitan's shell command splits them."""
        flags = shlex.split(" ".join(self.runs[run]).replace("{dump}", dump))
        for i, flag in enumerate(flags[:-1]):
            if flag == "--training.steps":
                flags[i + 1] = str(int(flags[i + 1]) // STEPS_SCALE)
        # torchtitan's c4_test files are in its repository: validation reads python_docs too.
        validation = ["--validation.dataset_path", "python_docs"] if "--validation.enable" in flags else []
        return [*COMMON, *validation, "--training.steps", "2", "--job.dump_folder", dump, *flags]


def _lists(*entries: tuple) -> tuple[FlagList, ...]:
    return tuple(
        FlagList(name, tuple(tuple(run) for run in runs), ranks, *expect) for name, runs, ranks, *expect in entries
    )


PP2 = "--parallelism.pipeline_parallel_degree 2"
TP2 = "--parallelism.tensor_parallel_degree 2"
CP2 = "--parallelism.context_parallel_degree=2"
# fmt: off
LISTS = _lists(
    ("default", [["--profiling.enable_profiling", "--metrics.enable_tensorboard"]], 4),
    ("1d_compile", [["--compile.enable"]], 4),
    ("1d_compile_sac_op", [["--compile.enable", "--activation_checkpoint.mode selective",
                            "--activation_checkpoint.selective_ac_option op"]], 4),
    ("2d_eager", [[TP2]], 4),
    ("2d_compile", [["--compile.enable", TP2]], 4),
    ("2d_asynctp_compile", [["--compile.enable", TP2, "--parallelism.enable_async_tensor_parallel"]], 4),
    ("full_checkpoint", [["--checkpoint.enable"], ["--checkpoint.enable", "--training.steps 20"]], 4),
    ("model_only_hf_checkpoint", [
        ["--checkpoint.enable", "--checkpoint.folder hf_checkpoint", "--checkpoint.last_save_model_only",
         "--checkpoint.last_save_in_hf"],
        ["--checkpoint.enable", f"--checkpoint.initial_load_path {HF_EXPORT}", "--checkpoint.initial_load_model_only",
         "--checkpoint.initial_load_in_hf"]], 4),
    ("last_save_model_only_fp32", [["--checkpoint.enable", "--checkpoint.last_save_model_only"]], 4),
    ("last_save_model_only_bf16", [["--checkpoint.enable", "--checkpoint.last_save_model_only",
                                    "--checkpoint.export_dtype bfloat16"]], 4),
    ("pp_looped_zero_bubble", [["--parallelism.pipeline_parallel_degree 4",
                                "--parallelism.pipeline_parallel_schedule InterleavedZeroBubble"]], 4),
    ("pp_zbv", [[PP2, "--parallelism.pipeline_parallel_schedule ZBVZeroBubble"]], 2),
    ("pp_1f1b", [[PP2, "--parallelism.pipeline_parallel_schedule 1F1B", "--parallelism.data_parallel_shard_degree 1"]], 2),
    ("pp_gpipe", [[PP2, "--parallelism.pipeline_parallel_schedule GPipe",
                   "--parallelism.data_parallel_shard_degree 1"]], 2),
    ("pp_dp_1f1b", [
        [PP2, "--parallelism.pipeline_parallel_schedule 1F1B", "--parallelism.data_parallel_shard_degree 2"],
        [PP2, "--parallelism.pipeline_parallel_schedule 1F1B", "--parallelism.pipeline_parallel_layers_per_stage 4",
         "--parallelism.data_parallel_shard_degree 2"]], 4),
    ("pp_dp_gpipe", [[PP2, "--parallelism.pipeline_parallel_schedule GPipe",
                      "--parallelism.data_parallel_shard_degree 2"]], 4),
    ("pp_tp", [[PP2, TP2]], 4),
    ("pp_dp_tp", [
        ["--checkpoint.enable", PP2, "--parallelism.data_parallel_shard_degree 2", TP2],
        ["--training.steps 20", "--checkpoint.enable", PP2, "--parallelism.data_parallel_shard_degree 2", TP2]], 8),
    ("3d_compile", [[PP2, "--parallelism.data_parallel_shard_degree 2", TP2, "--compile.enable"]], 8),
    ("pp_looped_1f1b", [
        ["--parallelism.pipeline_parallel_degree 4", "--parallelism.pipeline_parallel_schedule Interleaved1F1B"],
        ["--parallelism.pipeline_parallel_degree 4", "--parallelism.pipeline_parallel_schedule Interleaved1F1B",
         "--parallelism.pipeline_parallel_layers_per_stage 1"]], 4),
    ("pp_custom_csv", [[PP2, "--parallelism.pipeline_parallel_schedule PipelineScheduleMulti",
                        "--parallelism.pipeline_parallel_schedule_csv ./tests/assets/custom_schedule.csv"]], 2),
    ("optimizer_foreach", [["--optimizer.name AdamW --optimizer.implementation foreach"]], 2),
    ("ddp", [["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4"]], 4),
    ("hsdp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2"]], 4),
    ("fsdp+flex_attn", [["--parallelism.data_parallel_shard_degree=4", "--activation_checkpoint.mode='full'",
                         "--model.flavor=debugmodel_flex_attn"]], 4),
    ("fsdp+flex_attn+per_op_sac", [["--parallelism.data_parallel_shard_degree=4",
                                    "--activation_checkpoint.mode=selective",
                                    "--activation_checkpoint.selective_ac_option=op",
                                    "--model.flavor=debugmodel_flex_attn"]], 4),
    ("fsdp+varlen_attn+per_op_sac", [["--parallelism.data_parallel_shard_degree=4",
                                      "--activation_checkpoint.mode=selective",
                                      "--activation_checkpoint.selective_ac_option=op",
                                      "--model.flavor=debugmodel_varlen_attn"]], 4),
    ("cp_allgather", [["--parallelism.context_parallel_degree=4",
                       "--parallelism.context_parallel_rotate_method='allgather'"]], 4, "trains"),
    ("cp_alltoall", [["--parallelism.context_parallel_degree=4",
                      "--parallelism.context_parallel_rotate_method='alltoall'"]], 4, "trains"),
    ("hsdp+tp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.data_parallel_replicate_degree=2",
                  "--parallelism.tensor_parallel_degree=2"]], 8),
    ("fsdp+cp", [["--parallelism.data_parallel_shard_degree=2", CP2]], 4, "trains"),
    ("hsdp+cp_without_dp_shard", [["--parallelism.data_parallel_shard_degree=1",
                                   "--parallelism.data_parallel_replicate_degree=2", CP2]], 4, "trains"),
    ("hsdp+cp_with_dp_shard", [["--parallelism.data_parallel_shard_degree=2",
                                "--parallelism.data_parallel_replicate_degree=2", CP2]], 8, "trains"),
    ("fsdp+tp+cp", [["--parallelism.data_parallel_shard_degree=2", "--parallelism.tensor_parallel_degree=2", CP2]], 8,
     "trains"),
    ("cpu_offload+opt_in_bwd+TP+DP+CP", [
        ["--checkpoint.enable", "--parallelism.tensor_parallel_degree=2", CP2, "--training.enable_cpu_offload",
         "--optimizer.early_step_in_backward"],
        ["--parallelism.tensor_parallel_degree=2", CP2, "--parallelism.data_parallel_replicate_degree=2",
         "--training.enable_cpu_offload", "--optimizer.early_step_in_backward"]], 8, "trains"),
    ("fsdp2_memory_estimation", [["--memory_estimation.enable"]], 2),
    ("test_generate", [["--checkpoint.enable"], []], 2),
    ("fsdp_reshard_always", [["--parallelism.fsdp_reshard_after_forward always"]], 2),
    ("optional_checkpoint", [
        ["--checkpoint.enable", "--training.steps 10"],
        ["--checkpoint.enable", "--checkpoint.exclude_from_loading lr_scheduler,dataloader,optimizer", TP2,
         "--training.steps 20"]], 4),
    ("float8_emulation", [["--model.converters quantize.linear.float8",
                           "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                           "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                           "--quantize.linear.float8.emulate"]], 4),
    ("gradient_accumulation", [["--training.local_batch_size 8", "--training.global_batch_size 32"]], 2),
    ("validation_tp_cp_pp", [["--validation.enable", "--validation.dataset c4_test", TP2, CP2,
                              "--parallelism.pipeline_parallel_degree=2",
                              "--parallelism.pipeline_parallel_schedule Interleaved1F1B"]], 8, "trains"),
    ("dataloader_kwargs", [["--training.dataloader.num_workers", "2", "--training.dataloader.pin_memory",
                            "--training.dataloader.persistent_workers", "--training.dataloader.prefetch_factor",
                            "4"]], 2),
    # ft.py
    ("default_torchft", [[*FT, "--training.steps 10", "--checkpoint.enable"]], 8),
)
# fmt: on
