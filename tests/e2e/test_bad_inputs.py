"""A hundred mistakes: each ends with one `error:` line naming the option or path, exit code 2, no
traceback, and no rank started (run_train.sh's pre-launch check, programs/preflight.py, catches them)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import resource
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from config.errors import ConfigError
from config.manager import load_config
from programs import preflight, prepare_data
from tests.hf_folders import write_chat_tokenizer
from tests.launch import (
    NO_SMALL_DISK,
    REPO,
    TINY_RUN,
    run_script,
    script_command,
    script_env,
    small_disk,
)
from trainer import folders
from trainer.trainer import Trainer

_CHAT = ["--training.dataset_format", "chat", "--model.tokenizer_path", "{d}/chat_tokenizer"]
_PREPARED = ["--model.tokenizer_path", "{d}/chat_tokenizer", "--job.cache_dir", "{d}/cache"]
# (class of input, arguments, what the one line must say). {d} is a folder of prepared files.
CASES: list[tuple[str, list[str], str]] = [
    # Unknown options and sections, on the command line and in files.
    ("unknown", ["--training.stpes", "3"], "did you mean 'training.steps'"),
    ("unknown", ["--optimizer.momentum", "0.9"], "unknown option 'optimizer.momentum'"),
    ("unknown", ["--job.config_file", "{d}/unknown_key.toml"], "unknown option 'training.stepz'"),
    ("unknown", ["--job.config_file", "{d}/unknown_section.toml"], "unknown section [wandb]"),
    ("unknown", ["--job.config_file", "{d}/not_a_table.toml"], "'steps' must be a [section] table"),
    ("unknown", ["--job.config_file", "{d}/three_unknown.toml"], "unknown option 'checkpoint.every'"),
    ("unknown", ["--parallelism.sequence_parallel"], "unknown option 'parallelism.sequence_parallel'"),
    # Command-line syntax.
    ("syntax", ["steps=3"], "unexpected argument 'steps=3'"),
    ("syntax", ["--training.steps"], "--training.steps needs a value"),
    ("syntax", ["--", "--training.steps", "3"], "unexpected argument '--'"),
    ("syntax", ["-s", "3"], "unexpected argument '-s'"),
    ("syntax", ["--optimizer.lr"], "--optimizer.lr needs a value"),
    # Values of the wrong type.
    ("type", ["--training.steps", "three"], "training.steps: expected an integer"),
    ("type", ["--training.steps", "2.5"], "training.steps: expected an integer"),
    ("type", ["--optimizer.lr", "fast"], "optimizer.lr: expected a number"),
    ("type", ["--compile.enable", "maybe"], "compile.enable: expected true or false"),
    ("type", ["--job.config_file", "{d}/string_int.toml"], "training.steps: expected int, got the string"),
    ("type", ["--job.config_file", "{d}/list_int.toml"], "compile.manual_buckets: expected a string, got 1"),
    (  # read as a stage per name, then refused for what the stages held
        "type",
        ["--job.config_file", "{d}/flat_stages.toml"],
        "parallelism.module_fqns_per_model_part: expected a list of lists ([[...], [...]]), got ['tok_embeddings'",
    ),
    ("type", ["--training.max_norm", "none"], "training.max_norm: expected a number"),
    # Values out of range.
    ("range", ["--training.steps", "0"], "training.steps must be positive"),
    ("range", ["--training.max_norm", "-1"], "training.max_norm must be >= 0"),
    ("range", ["--training.global_batch_size", "0"], "training.global_batch_size must be -1 or positive"),
    ("range", ["--optimizer.lr", "0"], "optimizer.lr must be > 0"),
    ("range", ["--optimizer.lr", "-1e-3"], "optimizer.lr must be > 0"),
    ("range", ["--optimizer.beta1", "1.5"], "optimizer.betas must be two values in [0, 1)"),
    ("range", ["--optimizer.beta2", "-0.1"], "optimizer.betas must be two values in [0, 1)"),
    ("range", ["--optimizer.eps", "-1"], "optimizer.eps must be > 0"),
    ("range", ["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay must be >= 0"),
    ("range", ["--metrics.peak_flops", "-1"], "metrics.peak_flops must be positive"),
    ("range", ["--validation.enable", "--validation.steps", "-1"], "validation.steps must be positive"),
    ("range", ["--profiling.profiler_active", "20"], "profiling.profiler_active 20 is more steps than a window"),
    (
        "range",
        ["--validation.enable", "--validation.local_batch_size", "0"],
        "validation.local_batch_size must be positive",
    ),
    (
        "range",
        ["--validation.enable", "--validation.seq_len", "512"],
        "validation.seq_len 512 exceeds training.seq_len 256",
    ),
    (
        "layout",
        ["--validation.enable", "--parallelism.pipeline_parallel_degree", "2", "--validation.seq_len", "128"],
        "validation.seq_len: a pipeline validates with training's microbatches",
    ),
    ("range", ["--comm.alpha_us", "1", "--comm.bandwidth_gbps", "0"], "comm.bandwidth_gbps must be positive, got 0.0"),
    (
        "range",
        ["--model.rope_low_freq_factor", "4", "--model.rope_high_freq_factor", "1"],
        "model.rope_low_freq_factor 4.0 is not below model.rope_high_freq_factor 1.0",
    ),
    (
        "range",
        ["--parallelism.pipeline_parallel_first_stage_less_layers", "-1"],
        "parallelism.pipeline_parallel_first_stage_less_layers must be >= 0",
    ),
    # Choices.
    ("choice", ["--checkpoint.async_mode", "background"], "checkpoint.async_mode: 'background' is not one of"),
    ("choice", ["--parallelism.data_parallel_impl", "zero3"], "'zero3' is not one of fsdp2, simple_fsdp"),
    ("choice", ["--compile.bucketing", "greedy"], "compile.bucketing: 'greedy' is not one of"),
    ("choice", ["--compile.backend", "cudagraphs"], "compile.backend: 'cudagraphs' is not one of"),
    ("choice", ["--optimizer.name", "SGD"], "optimizer.name: 'SGD' is not one of AdamW, Adam"),
    ("choice", ["--compile.enable", "--compile.components", ""], "compile.components: empty, so compile.enable would"),
    (  # it compiled nothing, without a word
        "choice",
        ["--compile.enable", "--compile.components", "loss", "--parallelism.tensor_parallel_degree", "2"],
        "compile.components: the loss alone, which tensor parallelism runs eagerly, so compile.enable would",
    ),
    ("choice", ["--optimizer.implementation", "cuda-graph"], "optimizer.implementation: 'cuda-graph'"),
    ("choice", ["--lr_scheduler.decay_type", "exponential"], "lr_scheduler.decay_type: 'exponential'"),
    ("choice", ["--training.mixed_precision_param", "float16"], "training.mixed_precision_param: 'float16'"),
    ("choice", ["--activation_checkpoint.mode", "partial"], "activation_checkpoint.mode: 'partial'"),
    ("choice", ["--parallelism.pipeline_parallel_schedule", "PipeDream"], "'PipeDream' is not one of"),
    ("choice", ["--training.nonfinite_policy", "ignore"], "training.nonfinite_policy: 'ignore'"),
    # torchtitan's dry run asked of train.py (it trained for real, with a warning).
    ("choice", ["--comm.mode", "fake_backend"], "comm.mode='fake_backend'; a dry run is COMM_MODE=fake ./run_train.sh"),
    (
        "choice",
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"],
        "selective_ac_option: 'x' is neither 'op' nor a positive integer",
    ),
    (
        "choice",
        ["--activation_checkpoint.mode", "memory_budget"],
        "activation_checkpoint.mode memory_budget: the compiler picks what to recompute; set compile.enable",
    ),
    (
        "range",
        [
            "--activation_checkpoint.mode",
            "memory_budget",
            "--compile.enable",
            "--activation_checkpoint.memory_budget",
            "2",
        ],
        "activation_checkpoint.memory_budget must be in [0, 1], got 2.0",
    ),
    (
        "choice",
        ["--activation_checkpoint.mode", "full", "--activation_checkpoint.debug", "--compile.enable"],
        "activation_checkpoint.debug: torch records a checkpoint's ops only eagerly",
    ),
    # Layouts that cannot be built.
    ("layout", ["--parallelism.data_parallel_shard_degree", "4"], "multiply to 4"),
    ("layout", ["--parallelism.tensor_parallel_degree", "3"], "world size 2 is not divisible"),
    (
        "layout",
        ["--parallelism.data_parallel_replicate_degree", "0"],
        "data_parallel_replicate_degree must be positive",
    ),
    ("layout", ["--parallelism.data_parallel_shard_degree", "0"], "must be -1 or positive"),
    ("layout", ["--training.global_batch_size", "20"], "global_batch_size 20 is not divisible"),
    ("layout", ["--parallelism.context_parallel_degree", "3", "--training.seq_len", "96"], "cp 3"),
    (
        "layout",
        ["--parallelism.context_parallel_degree", "3"],
        "training.seq_len 256 does not split into 2 x parallelism.context_parallel_degree 3",
    ),
    ("layout", ["--parallelism.expert_parallel_degree", "2"], "not available in Tessera"),
    (
        "layout",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_layers_per_stage", "3"],
        "pipeline_parallel_layers_per_stage 3 gives 3 stages",
    ),
    (
        "layout",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.9"],
        "'layers.9' is not a split point",
    ),
    (  # a digit to str.isdigit, not to int(): int()'s message, naming no option
        "layout",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.²"],
        "pipeline_parallel_split_points: 'layers.²' is not a split point",
    ),
    (
        "layout",
        [
            *("--parallelism.pipeline_parallel_degree", "2", "--parallelism.module_fqns_per_model_part"),
            "tok_embeddings+layers.0+layers.²,layers.1+norm+output",
        ],
        "module_fqns_per_model_part: 'layers.²' is not a module of the model",
    ),
    (
        "layout",
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--compile.enable",
        ],
        "not supported with the ZBVZeroBubble",
    ),
    # Zero bubble's two backward passes: found before launch, not as a traceback in every rank.
    (
        "layout",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]
        + ["--compile.enable", "--compile.components", "loss"],
        "compile.components: a compiled loss is not supported with the ZBVZeroBubble pipeline schedule",
    ),
    (
        "layout",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
        + ["InterleavedZeroBubble", "--activation_checkpoint.mode", "selective"]
        + ["--activation_checkpoint.selective_ac_option", "op"],
        "activation_checkpoint.selective_ac_option: op is not supported with the InterleavedZeroBubble",
    ),
    (
        "layout",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
        "pipeline_parallel_microbatch_size",
    ),
    ("layout", ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "65"], "does not divide"),
    ("layout", ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"], "run it on 1 rank"),
    (
        "layout",
        ["--optimizer.early_step_in_backward", "--parallelism.pipeline_parallel_degree", "2"],
        "optimizer.early_step_in_backward: not with pipeline parallelism",
    ),
    (
        "choice",
        ["--optimizer.early_step_in_backward", "--debug.fail_at_step", "2", "--debug.failure", "nan"],
        "debug.failure nan: it poisons the gradients before the update",
    ),
    (
        "choice",
        ["--optimizer.early_step_in_backward", "--training.nonfinite_policy", "skip_step"],
        "training.nonfinite_policy skip_step: the update it would skip has happened in backward",
    ),
    ("choice", ["--model.converters", "mx"], "model.converters: 'mx' is not one of float8"),
    ("choice", ["--float8.recipe_name", "blockwise"], "float8.recipe_name: 'blockwise' is not one of"),
    (
        "choice",
        [
            *("--model.converters", "float8", "--float8.recipe_name", "rowwise_with_gw_hp"),
            *("--float8.filter_fqns", "auto_filter_small_kn"),
        ],
        "float8.filter_fqns: torchao's auto_filter_small_kn has thresholds for the tensorwise and rowwise",
    ),
    (
        "choice",
        ["--model.converters", "float8", "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
        "float8.enable_fsdp_float8_all_gather: a gather casts with one scale per weight",
    ),
    (
        "choice",
        [
            *("--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather"),
            *("--parallelism.data_parallel_impl", "simple_fsdp"),
        ],
        "float8.enable_fsdp_float8_all_gather: FSDP2's",
    ),
    (
        "layout",
        ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.enable", "--compile.manual_buckets", "layers.9"],
        "compile.manual_buckets: Bucket pattern 'layers.9' (in spec 'layers.9') matches no module of",
    ),
    (  # it left nothing out of float8, without a word
        "layout",
        ["--model.converters", "float8", "--float8.filter_fqns", "output,outptu"],
        "float8.filter_fqns: 'outptu': part of no linear layer's name (they are layers.N.attention.wq, ",
    ),
    # LR schedules that do not fit.
    ("schedule", ["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps must be >= 0"),
    ("schedule", ["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio must be in [0, 1]"),
    ("schedule", ["--lr_scheduler.min_lr_factor", "2"], "lr_scheduler.min_lr_factor must be in [0, 1]"),
    ("schedule", ["--lr_scheduler.total_steps", "0"], "lr_scheduler.total_steps must be >= 1"),
    # Checkpoint options that do not go together.
    ("checkpoint", ["--checkpoint.interval", "0"], "checkpoint.interval must be positive"),
    ("checkpoint", ["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k must be >= 0"),
    ("checkpoint", ["--checkpoint.load_step", "5"], "checkpoint.load_step needs checkpoint.enable"),
    (
        "checkpoint",
        ["--checkpoint.enable", "--checkpoint.load_step", "5"],
        "checkpoint.load_step: no complete checkpoint step-5 in {d}/dump/checkpoint",
    ),
    ("checkpoint", ["--checkpoint.export_hf"], "checkpoint.export_hf needs checkpoint.enable"),
    ("checkpoint", ["--checkpoint.load_only"], "checkpoint.load_only needs checkpoint.enable"),
    (
        "checkpoint",
        ["--checkpoint.enable", "--checkpoint.load_only", "--checkpoint.enable_first_step_checkpoint"],
        "checkpoint.enable_first_step_checkpoint: it saves, which checkpoint.load_only rules out",
    ),
    ("checkpoint", ["--training.nonfinite_policy", "rollback"], "'rollback' needs checkpoint.enable"),
    ("checkpoint", ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizr"], "did you mean"),
    (
        "checkpoint",
        [
            "--checkpoint.enable",
            "--checkpoint.exclude_from_loading",
            "model,optimizer,lr_scheduler,dataloader,train_state",
        ],
        "checkpoint.exclude_from_loading: every part",
    ),
    (  # an earlier seed: the new one would write over it
        "checkpoint",
        ["--nproc-per-node", "1", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
        + ["--checkpoint.folder", "{d}/seeded"],
        "checkpoint.create_seed_checkpoint: {d}/seeded/step-0 already holds a checkpoint",
    ),
    (  # another tool's checkpoint (no marker): a save of step 2 would write into it
        "checkpoint",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/titan_ckpts"],
        "checkpoint.folder: {d}/titan_ckpts/step-2 holds files no save of this trainer wrote",
    ),
    (  # a model card added to an earlier export: the export replaces the folder whole
        "checkpoint",
        ["--checkpoint.enable", "--checkpoint.export_hf", "--checkpoint.folder", "{d}/exported"],
        "checkpoint.export_hf: {d}/exported/hf holds files no export wrote (README.md)",
    ),
    ("checkpoint", ["--comm.alpha_us", "10"], "comm.alpha_us and comm.bandwidth_gbps go together"),
    # Each of these passed the check and failed in every rank, restarted (or trained a model without
    # feed-forward layers, or on the defaults alone).
    ("files", ["--job.config_file", ""], "job.config_file: no file given"),
    ("files", ["--job.config_file", "/dev/null"], "config file is not a regular file: /dev/null"),
    (
        "files",
        ["--job.config_file", "{d}/quoted_key.toml"],
        "training.steps 5 and training.steps 3 in {d}/quoted_key.toml contradict each other: the same option twice",
    ),
    ("files", ["--job.save_config_file", "validation.jsonl"], "job.save_config_file: validation.jsonl is the"),
    ("files", ["--job.save_config_file", ".tessera.lock"], "job.save_config_file: .tessera.lock is the"),
    ("range", ["--model.ffn_dim_multiplier", "0.001"], "ffn_dim_multiplier 0.001 leaves the feed-forward no"),
    ("range", ["--model.default_tokenizer_vocab_size", "10"], "model.default_tokenizer_vocab_size must be at least"),
    # Missing or broken files and folders.
    ("files", ["--job.config_file", "{d}/missing.toml"], "config file not found: {d}/missing.toml"),
    ("files", ["--job.config_file", "{d}/broken.toml"], "invalid TOML"),
    # Said to be a folder, not "not found".
    ("files", ["--job.config_file", "{d}/empty_folder"], "config file is a folder: {d}/empty_folder"),
    ("files", ["--training.dataset", "{d}/missing.jsonl"], "dataset path not found: {d}/missing.jsonl"),
    ("files", ["--training.dataset", "tessera-test/no-such-dataset"], "Hugging Face hub"),  # offline or not
    (
        "files",
        ["--training.dataset", "{d}/empty_folder"],
        "contains no .txt, .jsonl, .parquet, .arrow, .json, .json.gz, .jsonl.gz files",
    ),
    ("files", ["--training.dataset", "{d}/bad.jsonl"], "invalid JSON"),
    ("files", ["--training.dataset", "{d}/no_text.jsonl"], "expected an object with a string 'text' field"),
    ("files", ["--training.dataset", "{d}/corpus.csv"], "does not end in one of .txt, .jsonl, .parquet, .arrow, .json"),
    ("files", ["--validation.enable", "--validation.dataset", "{d}/missing_val.jsonl"], "validation.dataset"),
    ("files", ["--model.tokenizer_path", "{d}/missing_tokenizer"], "tokenizer path not found"),
    # torchtitan's name for model.tokenizer_path, named as given (it named Tessera's option).
    ("files", ["--model.hf_assets_path", "{d}/empty_folder"], "error: model.hf_assets_path: tokenizer folder"),
    ("files", ["--model.tokenizer_path", "{d}/broken.model"], "tokenizer"),
    ("files", ["--checkpoint.initial_load_path", "{d}/missing_ckpt"], "is not a folder"),
    ("files", ["--checkpoint.initial_load_path", "{d}/empty_folder"], "neither a DCP checkpoint nor a Hugging Face"),
    # A DCP checkpoint of another model: found by the ranks after launch otherwise.
    (
        "files",
        ["--checkpoint.initial_load_path", "{d}/narrow_ckpt"],
        "checkpoint.initial_load_path: {d}/narrow_ckpt holds another model than this job's: ",
    ),
    # Empty corpora: a rank's error after launch otherwise.
    ("files", ["--training.dataset", "{d}/empty.txt"], "training.dataset: {d}/empty.txt: empty, no text to train on"),
    ("files", ["--training.dataset", "{d}/empty_list.json"], "training.dataset: {d}/empty_list.json: no documents"),
    (
        "files",
        ["--checkpoint.initial_load_path", "{d}/hf_text_sizes"],
        "{d}/hf_text_sizes/config.json: hidden_size='256' is not a positive integer; rms_norm_eps=-1 is not a positive",
    ),
    # Folders the run writes to (/proc takes no new folders, whoever runs the tests).
    ("folders", ["--job.dump_folder", "{d}/bad.jsonl"], "job.dump_folder: {d}/bad.jsonl is not a folder"),
    (
        "folders",
        ["--checkpoint.enable", "--checkpoint.folder", "/proc/tessera_checkpoints"],
        "checkpoint.folder: cannot create /proc/tessera_checkpoints: nothing can be written in /proc",
    ),
    (
        "folders",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/bad.jsonl/checkpoint"],
        "checkpoint.folder: cannot create {d}/bad.jsonl/checkpoint: {d}/bad.jsonl is not a folder",
    ),
    ("folders", ["--metrics.save_tb_folder", "/proc/tessera_tb"], "metrics.save_tb_folder: cannot create /proc/"),
    (
        "folders",
        ["--profiling.enable_profiling", "--profiling.save_traces_folder", "/proc/tessera_traces"],
        "profiling.save_traces_folder: cannot create /proc/tessera_traces",
    ),
    (
        "folders",
        ["--profiling.enable_memory_snapshot", "--profiling.save_memory_snapshot_folder", "/proc/tessera_snapshots"],
        "profiling.save_memory_snapshot_folder: cannot create /proc/tessera_snapshots",
    ),
    ("folders", ["--job.cache_dir", "/proc/tessera_cache"], "job.cache_dir: cannot create /proc/tessera_cache"),
    ("folders", ["--comm.save_traces_folder", "/proc/tessera_fr"], "comm.save_traces_folder: cannot create /proc/"),
    ("folders", ["--job.save_config_file", "/proc/tessera/job.json"], "job.save_config_file: cannot create /proc/"),
    ("folders", ["--job.dump_folder", ""], "job.dump_folder: no folder given ('.' is the working folder)"),
    ("folders", ["--job.dump_folder", " "], "job.dump_folder: no folder given ('.' is the working folder)"),
    ("folders", ["--job.run_name", "../../etc"], "job.run_name: '../../etc' is not a plain folder name"),
    (  # the record of a failed collective was lost at the failure, with a warning naming the folder
        "folders",
        ["--comm.save_traces_file_prefix", "traces/rank_"],
        "comm.save_traces_file_prefix: 'traces/rank_' holds a '/'; it begins the file names in",
    ),
    # Folders at files the run writes: a traceback or a failed save in the ranks, then a restart.
    (
        "folders",
        ["--metrics.save_tb_folder", "metrics.jsonl"],
        "metrics.save_tb_folder: {d}/dump/metrics.jsonl would make a folder of metrics.jsonl, a file the run",
    ),
    (
        "folders",
        ["--validation.enable", "--checkpoint.enable", "--checkpoint.folder", "validation.jsonl"],
        "checkpoint.folder: {d}/dump/validation.jsonl would make a folder of validation.jsonl",
    ),
    (
        "folders",
        ["--profiling.enable_profiling", "--profiling.save_traces_folder", "config.toml/traces"],
        "profiling.save_traces_folder: {d}/dump/config.toml/traces would make a folder of config.toml",
    ),
    # Files the run writes that are its input, or each other.
    (
        "folders",
        ["--job.config_file", "{d}/users/config.toml", "--job.dump_folder", "{d}/users"],
        "job.config_file: {d}/users/config.toml is the config",
    ),
    (
        "folders",
        ["--job.dump_folder", "{d}/users"],
        "job.dump_folder: {d}/users/config.toml was not written by a run, and this run would overwrite it",
    ),
    (
        "folders",
        ["--job.dump_folder", "{d}/jsons", "--job.save_config_file", "job.json"],
        "job.save_config_file: {d}/jsons/job.json exists and is not a config a run wrote; the run would overwrite it",
    ),
    ("folders", ["--job.save_config_file", "config.toml"], "job.save_config_file: config.toml is the config.toml"),
    ("folders", ["--job.save_config_file", "./metrics.jsonl"], "job.save_config_file: ./metrics.jsonl is the metrics"),
    ("folders", ["--job.save_config_file", "tb"], "job.save_config_file: tb is the folder of metrics.save_tb_folder"),
    ("folders", ["--job.save_config_file", "../job.json"], "job.save_config_file: ../job.json is not a file inside"),
    ("folders", ["--job.save_config_file", "{d}/jsons/job.json"], "job.save_config_file: {d}/jsons/job.json is not a"),
    (
        "folders",
        ["--job.save_config_file", "../jsons/job.json"],
        "job.save_config_file: ../jsons/job.json is not a file inside",
    ),
    # A model or a batch that cannot fit a rank (3 TiB of 405B's state, 10 TiB of logits: on any host).
    (
        "memory",
        ["--model.flavor", "405B"],
        "float32 weights, gradients and Adam moments alone take 2993.0 GiB per rank",
    ),
    (
        "memory",
        ["--model.flavor", "405B", "--training.dtype", "bfloat16"],
        "bfloat16 weights, gradients and Adam moments alone take 1496.5 GiB per rank",
    ),
    (
        "memory",
        ["--training.local_batch_size", "10000000"],
        "training.local_batch_size 10000000 x training.seq_len 256: the logits of one forward alone take 9765.6 GiB",
    ),
    (
        "memory",
        ["--validation.enable", "--validation.local_batch_size", "10000000"],
        "validation.local_batch_size 10000000 x validation.seq_len 256: the logits of one forward alone take",
    ),
    # Mixtures and chat data.
    (
        "data",
        ["--training.datasets", "a.txt,b.txt", "--training.dataset_weights", "0.5,0"],
        "training.dataset_weights must be positive",
    ),
    (
        "data",
        ["--training.datasets", "a.txt,b.txt", "--training.dataset_weights", "1"],
        "training.dataset_weights: [1.0] is not one weight per corpus",
    ),
    ("data", ["--training.dataset_format", "chat"], "give the Hugging Face folder as model.tokenizer_path"),
    (
        "data",
        [*_CHAT, "--training.dataset", "{d}/no_text.jsonl"],
        "no_text.jsonl:1: expected an object with a 'messages'",
    ),
    ("data", [*_CHAT, "--training.dataset", "{d}/narrator.jsonl"], "has the role 'narrator'"),
    (
        "data",
        [*_CHAT, "--model.tokenizer_path", "{d}/no_template", "--training.dataset", "{d}/narrator.jsonl"],
        "no chat template",
    ),
    (  # a prepared corpus whose shard was deleted afterwards
        "data",
        [*_PREPARED, "--training.dataset", "{d}/prepared.txt"],
        "is incomplete or damaged (shard-00000.tokens is missing); delete it and it is rebuilt",
    ),
    # 9999 CPU processes of torch: 3 TiB before any model (a host's swap storm, then the OOM killer).
    ("memory", ["--nproc-per-node", "9999"], "NGPU 9999: each CPU rank's process takes about 0.3 GiB before any"),
]


def _prepare(d) -> None:
    files = {
        "unknown_key.toml": "[training]\nstepz = 3\n",
        "unknown_section.toml": "[wandb]\nproject = 'x'\n",
        "not_a_table.toml": "steps = 3\n",
        "three_unknown.toml": "[checkpoint]\nevery = 3\n[training]\nepochs = 2\n[optimizer]\nmomentum = 0.9\n",
        "string_int.toml": "[training]\nsteps = '3'\n",
        "list_int.toml": "[compile]\nmanual_buckets = [1, 2]\n",
        "flat_stages.toml": "[parallelism]\nmodule_fqns_per_model_part = ['tok_embeddings', 'layers.0']\n",
        "broken.toml": "[training\nsteps = 3\n",
        "bad.jsonl": "{not json\n",
        "no_text.jsonl": json.dumps({"content": "x"}) + "\n",
        "corpus.csv": "a,b\n",
        "broken.model": "this is not a tokenizer\n",
        "empty.txt": "",
        "empty_list.json": "[]\n",
        "quoted_key.toml": '"training.steps" = 5\n[training]\nsteps = 3\n',
    }
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "empty_folder").mkdir()
    narrator = [{"role": "narrator", "content": "Once"}, {"role": "assistant", "content": "upon"}]
    (d / "narrator.jsonl").write_text(json.dumps({"messages": narrator}) + "\n")
    write_chat_tokenizer(str(d / "chat_tokenizer"))
    write_chat_tokenizer(str(d / "no_template"), chat_template=None)
    with warnings.catch_warnings():  # DCP's note that it saves in one process: it is meant to
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"tok_embeddings.weight": torch.zeros(2, 3)}}, checkpoint_id=str(d / "narrow_ckpt"))
        dcp.save({"model": {"tok_embeddings.weight": torch.zeros(2, 3)}}, checkpoint_id=str(d / "seeded" / "step-0"))
        dcp.save({"tok_embeddings.weight": torch.zeros(2, 3)}, checkpoint_id=str(d / "titan_ckpts" / "step-2"))
    hf = d / "hf_text_sizes"  # sizes as text and a negative epsilon: a TypeError in torch otherwise
    hf.mkdir()
    sizes = {"hidden_size": "256", "num_hidden_layers": 6, "num_attention_heads": 16, "intermediate_size": 768}
    (hf / "config.json").write_text(json.dumps({**sizes, "vocab_size": 2048, "rms_norm_eps": -1, "rope_theta": 5e5}))
    (hf / "model.safetensors").write_bytes(b"")
    (d / "users").mkdir()
    (d / "users" / "config.toml").write_text("# the user's own\n[training]\nsteps = 3\n")
    (d / "exported" / "hf").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        (d / "exported" / "hf" / name).write_text("{}")
    (d / "jsons").mkdir()
    (d / "jsons" / "job.json").write_text('{"job": {}}')
    (d / "prepared.txt").write_text("a corpus prepared ahead of its run\n" * 50)
    prepared = [arg.format(d=d) for arg in [*_PREPARED, "--training.dataset", "{d}/prepared.txt"]]
    with contextlib.redirect_stdout(io.StringIO()):  # its report, which no case's output should hold
        assert prepare_data.main(["--training.dataset_prepare_workers", "1", *prepared]) == 0
    (shard,) = d.glob("cache/tokens-*/shard-00000.tokens")
    shard.unlink()


def _one_error_line(code: int, stderr: str, expected: str) -> bool:
    lines = [line for line in stderr.splitlines() if not line.startswith("warning:")]
    return code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_a_hundred_mistakes_each_get_one_line(tmp_path, capsys):
    """Every case through the pre-launch check, in this process: what run_train.sh runs before it
    starts any rank (the launches below show the script passes its line on unchanged)."""
    assert len(CASES) >= 100, len(CASES)
    _prepare(tmp_path)
    config = os.path.join(REPO, "configs", "debug_model.toml")
    failures = []
    for kind, args, expected in CASES:
        args = [arg.format(d=tmp_path) for arg in args]
        ranks, args = (args[1], args[2:]) if args[0] == "--nproc-per-node" else ("2", args)  # NGPU
        argv = ["--nnodes", "1", "--nproc-per-node", ranks, "--job.config_file", config]
        argv += ["--job.dump_folder", str(tmp_path / "dump"), *args]
        try:
            code = preflight.main(argv)
        except BaseException as e:  # a traceback in the real launch
            code = f"raised {e!r}"
        out = capsys.readouterr()
        if not _one_error_line(code, out.err, expected.format(d=tmp_path)) or out.out:
            failures.append(f"{kind} {args}: exit {code}, stdout {out.out!r}, stderr {out.err[-600:]!r}")
    assert not failures, f"{len(failures)} of {len(CASES)} inputs:\n" + "\n".join(failures)


@pytest.mark.slow  # twelve launches of run_train.sh
def test_one_mistake_of_each_class_through_run_train_sh(tmp_path):
    """The first case of each class, as users meet it: one line from the script, exit 2, no
    traceback, no rank started."""
    _prepare(tmp_path)
    firsts = {kind: (args, expected) for kind, args, expected in reversed(CASES)}
    assert len(firsts) == 12, sorted(firsts)

    def launch(case: tuple[list[str], str]):
        args = [arg.format(d=tmp_path) for arg in case[0]]
        return args, run_script(str(tmp_path / "dump"), *args, check=False, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(launch, firsts.values()))
    failures = [
        f"{args}: exit {result.returncode}, stderr {result.stderr[-600:]!r}"
        for (args, result), (_, expected) in zip(results, firsts.values())
        if not _one_error_line(result.returncode, result.stderr, expected.format(d=tmp_path))
        or "Traceback" in result.stderr + result.stdout
        or "[rank" in result.stderr + result.stdout  # caught before any rank started
    ]
    assert not failures, "\n".join(failures)


ENVIRONMENT_CASES = [
    ({"NGPU": "abc"}, "error: NGPU: 'abc' is not a number of ranks per node"),
    ({"NGPU": "0"}, "error: NGPU: '0' is not a number of ranks per node"),
    ({"NNODES": "x"}, "error: NNODES: 'x' is not a number of nodes"),
    ({"MAX_RESTARTS": "-1"}, "error: MAX_RESTARTS: '-1' is not a number of restarts"),
    ({"LOG_RANK": "0,x"}, "error: LOG_RANK: '0,x' is not a list of local ranks (e.g. 0,1)"),
    ({"LOG_RANK": "0,3"}, "error: LOG_RANK: 3 is not a local rank of this node's 2 (0 to 1)"),
    # A dry run ends as the real run would (it ran, and ended 0).
    ({"COMM_MODE": "fake", "LOG_RANK": "3"}, "error: LOG_RANK: 3 is not a local rank of this node's 2 (0 to 1)"),
    (  # NGPU=auto: CPU processes 2 here, as the launch counts them
        {"COMM_MODE": "fake", "LOG_RANK": "3", "NGPU": ""},
        "error: LOG_RANK: 3 is not a local rank of this node's 2 (0 to 1)",
    ),
    ({"NNODES": "2"}, "error: RDZV_ENDPOINT: set it to host:port of the first node for a job of 2 nodes"),
    ({"COMM_MODE": "real"}, "error: COMM_MODE: 'real' is not a mode; the one there is: fake (or fake_backend)"),
    ({"CONFIG_FILE": "/nowhere/job.toml"}, "error: CONFIG_FILE: /nowhere/job.toml: no such file"),
    ({"CONFIG_FILE": "/tmp"}, "error: CONFIG_FILE: /tmp is a folder, not a TOML file"),
    # OpenMP's own complaint in every rank, then as many threads as cores in each.
    ({"OMP_NUM_THREADS": "abc"}, "error: OMP_NUM_THREADS: 'abc' is not a number of threads"),
    # torchrun's agent: a traceback, then restarts.
    (
        {"NNODES": "2", "RDZV_ENDPOINT": "a:b"},
        "error: RDZV_ENDPOINT: 'a:b' is not host:port of the first node (e.g. node0:29500)",
    ),
    # A bash message and exit code 127.
    (
        {"PYTHON": "/nonexistent/python"},
        "error: PYTHON: '/nonexistent/python' is not a Python 3.10 or newer interpreter",
    ),
]


@pytest.mark.slow  # launches run_train.sh
@pytest.mark.parametrize("env, line", ENVIRONMENT_CASES, ids=[",".join(env) for env, _ in ENVIRONMENT_CASES])
def test_a_mistake_in_the_environment_is_one_line(tmp_path, env, line):
    """run_train.sh's own settings: one line, exit 2, before any rank (a traceback of int(), a bash
    message with exit 1, or, for a rank this node does not have, a run that showed nothing)."""
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, **env}
    result = subprocess.run(script_command(str(tmp_path)), cwd=REPO, env=env, capture_output=True, text=True)
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [line]), result.stderr[-2000:]
    assert "[rank" not in result.stdout + result.stderr


ENVIRONMENT_WARNINGS = [
    # A job of this node alone, said once, not silently.
    ({"RDZV_ENDPOINT": "node0:29500"}, "warning: RDZV_ENDPOINT is set but NNODES is 1: a job of this node alone"),
    ({"RDZV_ID": "job42"}, "warning: RDZV_ID is set but NNODES is 1: a job of this node alone"),
    # Two config files: the one on the command line is read.
    (
        {"CONFIG_FILE": "/nowhere/job.toml"},
        "warning: CONFIG_FILE=/nowhere/job.toml is not read: --job.config_file on the command line wins",
    ),
]


@pytest.mark.slow  # launches run_train.sh
@pytest.mark.parametrize("env, warning", ENVIRONMENT_WARNINGS, ids=[",".join(env) for env, _ in ENVIRONMENT_WARNINGS])
def test_an_environment_setting_without_effect_is_a_warning(tmp_path, env, warning):
    """A misspelled option afterwards ends the launch early: the warning, then its error line."""
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, **env}
    config = os.path.join(REPO, "configs", "debug_model.toml")
    command = script_command(str(tmp_path)) + ["--job.config_file", config, "--training.stpes", "3"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert (result.returncode, len(lines), lines[-1]) == (
        2,
        2,
        "error: unknown option 'training.stpes' (did you mean 'training.steps'?)",
    ), result.stderr[-2000:]
    assert lines[0].startswith(warning)


@pytest.mark.slow  # launches run_train.sh
def test_two_config_files_typed_are_a_warning_and_one_is_not(tmp_path):
    """The first of two files is not read: a warning, as for any option typed twice (it was dropped
    without a word). One file typed is no such warning: the script's default config is not counted."""
    config = os.path.join(REPO, "configs", "debug_model.toml")
    lines = []
    for files in ([config, config], [config]):
        typed = [arg for path in files for arg in ("--job.config_file", path)]
        command = script_command(str(tmp_path), *typed, "--training.stpes", "3")
        result = subprocess.run(command, cwd=REPO, env=script_env(2), capture_output=True, text=True, timeout=120)
        lines.append(result.stderr.strip().splitlines())
    error = "error: unknown option 'training.stpes' (did you mean 'training.steps'?)"
    assert lines == [["warning: given more than once, the last counts: --job.config_file (2 times)", error], [error]]


def test_the_ranks_check_the_output_folders_themselves(tmp_path):
    """Started by torchrun without run_train.sh's check, rank 0 refuses an unwritable checkpoint
    folder with the same line before it joins the process group, not at its first save."""
    (tmp_path / "a_file").write_text("")
    folder = str(tmp_path / "a_file" / "checkpoint")
    config = load_config(["--checkpoint.enable", "--checkpoint.folder", folder, "--job.dump_folder", str(tmp_path)])
    with pytest.raises(ConfigError, match=f"^checkpoint.folder: cannot create {folder}: .* is not a folder$"):
        Trainer(config)
    assert not dist.is_initialized()
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # the check leaves nothing behind


def test_the_other_ranks_never_see_a_part_of_the_resolved_config(tmp_path):
    """A check of the dump folder's config.toml (and job.save_config_file) while rank 0 writes them
    (another node's pre-launch check, or the ranks of a restart) must see the whole file, never the
    empty one a plain write leaves for a moment."""
    from config.job_config import RESOLVED_CONFIG_HEADER
    from config.manager import to_toml

    config = load_config(["--job.dump_folder", str(tmp_path), "--job.save_config_file", "job.json"])
    resolved, saved = RESOLVED_CONFIG_HEADER + to_toml(config), json.dumps(dataclasses.asdict(config))
    folders.write_run_file(str(tmp_path / "config.toml"), resolved)
    folders.write_run_file(str(tmp_path / "job.json"), saved)
    done = threading.Event()

    def rank_0_writes() -> None:
        while not done.is_set():
            folders.write_run_file(str(tmp_path / "config.toml"), resolved)
            folders.write_run_file(str(tmp_path / "job.json"), saved)

    writer = threading.Thread(target=rank_0_writes)
    writer.start()
    try:
        for _ in range(800):
            folders.check_output_folders(config)
    finally:
        done.set()
        writer.join()


def test_a_dump_folder_in_use_by_another_run_is_refused(tmp_path):
    """A second run started on the folder of a run still going (which would interleave metrics and
    resume from and delete the other's checkpoints), or on its checkpoint folder outside its dump
    folder, is one line, before launch and in the ranks; once the first run's process is gone, the
    folders are free: no stale claim."""
    dump, checkpoints = str(tmp_path / "run"), str(tmp_path / "checkpoints")
    argv = ["--job.dump_folder", dump, "--checkpoint.enable", "--checkpoint.folder", checkpoints]
    hold = "import sys, time; from config.manager import load_config; from trainer.folders import claim_folders"
    hold += "; held = claim_folders(load_config(sys.argv[1:])); print(1)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold + "; sys.stdout.flush(); time.sleep(600)", *argv],
        env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE,
        text=True,
    )
    same_dump = load_config(["--job.dump_folder", dump])
    same_checkpoints = load_config([*argv[:1], str(tmp_path / "other"), *argv[2:]])
    try:
        assert holder.stdout.readline() == "1\n"
        for config, option, folder in [
            (same_dump, "job.dump_folder", dump),
            (same_checkpoints, "checkpoint.folder", checkpoints),
        ]:
            message = rf"^{option}: {folder} is in use by another run \(process {holder.pid} on .*\); stop it, or"
            with pytest.raises(ConfigError, match=message):
                preflight.check(config, 1, ranks_per_node=1)
            with pytest.raises(ConfigError, match=message):
                Trainer(config)
            assert not dist.is_initialized()
            preflight.check(config, 1)  # a dry run may look on
    finally:
        holder.kill()
        holder.wait()
    preflight.check(same_dump, 1, ranks_per_node=1)
    preflight.check(same_checkpoints, 1, ranks_per_node=1)


def test_a_seed_checkpoint_must_fit_one_process(capsys):
    argv = ["--nnodes", "1", "--nproc-per-node", "1", "--model.flavor", "405B"]
    assert preflight.main([*argv, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]) == 2
    assert "a seed checkpoint holds all the weights in one process, 1496.5 GiB" in capsys.readouterr().err


@pytest.mark.slow  # launches run_train.sh
def test_a_mistake_found_inside_the_ranks_is_not_retried(tmp_path):
    """A corpus shorter than one sequence only shows once the ranks tokenize it: one line, exit 2,
    and torchrun does not start the group again."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("too short")
    result = run_script(str(tmp_path / "dump"), "--training.dataset", str(corpus), check=False, timeout=600)
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, output[-3000:]
    assert errors == [errors[-1]] and "training.dataset" in errors[0] and "fewer than one window" in errors[0]
    assert result.stderr.rstrip().endswith(errors[0])  # the script's last word
    assert "Traceback" not in output and "ChildFailedError" not in output
    assert "will restart" not in output and "Restarting" not in output


@pytest.mark.slow  # launches run_train.sh
def test_one_rank_out_of_memory_is_not_retried_either(tmp_path):
    """The last rank alone runs out (injected, as a pipeline's last stage can): its peer's broken
    collective does not make torchrun start the group again (it did, once, before the next attempt
    found the error file), and the script's last word is the rank's line."""
    oom = ["--debug.fail_at_step", "2", "--debug.failure", "oom", "--lr_scheduler.warmup_steps", "1"]
    result = run_script(str(tmp_path / "dump"), *TINY_RUN, *oom, env={"LOG_RANK": "0,1"}, check=False, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: training.local_batch_size: out of memory in step 2 on rank 1 (debug.failure=oom")
    assert "Restarting" not in output and "a collective failed" not in output, output[-3000:]


def _big_batch(tmp_path, batch: list[str], nproc: int, limit_memory) -> subprocess.CompletedProcess:
    """3 steps of ./run_train.sh on ``nproc`` ranks with the options of ``batch``, started after
    ``limit_memory`` (a ``preexec_fn``)."""
    command = script_command(str(tmp_path / "dump"), *batch, "--training.steps", "3")
    return subprocess.run(
        [*command, "--lr_scheduler.warmup_steps", "1"],
        cwd=REPO,
        env=script_env(nproc),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_memory,
    )


@pytest.mark.slow  # launches run_train.sh
def test_running_out_of_memory_is_one_line_and_not_retried(tmp_path):
    """A batch too big for the memory the ranks may use (here an address-space limit of 6 GB, under
    which the pre-launch floor still passes): one line naming the option, exit 2, and no restart
    (each of torchrun's attempts ran out again, a traceback each, and ended in a failed job)."""
    limit = 6 * 10**9
    result = _big_batch(
        tmp_path,
        ["--training.local_batch_size", "600"],
        2,
        lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: training.local_batch_size: out of memory in step 1 on rank "), output[-3000:]
    assert "can't allocate memory" in last and "activation_checkpoint.mode" in last
    assert "Traceback" not in output and "Restarting" not in output and "a collective failed" not in output


@pytest.mark.slow  # launches run_train.sh
def test_validation_running_out_of_memory_names_its_batch(tmp_path):
    """Training's batches fit, validation's do not: the line names validation.local_batch_size (it
    named training's option, whose batches had just run)."""
    limit = 6 * 10**9
    # 2000 sequences: their float32 logits alone pass the 6 GB limit (600 fitted in one CI run of four).
    validation = ["--validation.enable", "--validation.freq", "2", "--validation.local_batch_size", "2000"]
    result = _big_batch(tmp_path, validation, 2, lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    # The first validation follows step 1 (as torchtitan's).
    assert last.startswith("error: validation.local_batch_size: out of memory in validation after step 1 on rank ")
    assert "in [validation]" in last and "Traceback" not in output and "Restarting" not in output


@pytest.mark.slow  # launches run_train.sh
def test_a_full_disk_is_one_line_before_launch_and_after_a_save_it_cut_short(tmp_path):
    """A dump folder on a full disk: one line before launch (a probe write; a new folder name is
    still made on a full disk). A disk that fills during a save: the save's line says the disk is
    full, and the restart ends in the folders' line, exit 2 (tracebacks in every attempt before)."""
    disk = str(tmp_path / "disk")
    with small_disk(disk, "3m") as mounted:
        if not mounted:
            pytest.skip(NO_SMALL_DISK)
        with open(os.path.join(disk, "fill"), "wb") as f, contextlib.suppress(OSError):
            f.write(bytes(4 * 2**20))
        argv = ["--nnodes", "1", "--nproc-per-node", "2", "--job.dump_folder", os.path.join(disk, "run")]
        result = subprocess.run(
            [sys.executable, "-m", "programs.preflight", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        expected = f"job.dump_folder: cannot create {disk}/run: nothing can be written in {disk} (No space left"
        assert _one_error_line(result.returncode, result.stderr, expected), result.stderr
        os.remove(os.path.join(disk, "fill"))
        checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "1", "--model.n_layers", "2"]
        result = run_script(os.path.join(disk, "run"), *checkpoints, "--training.steps", "3", check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "(its disk is full: " in output and "Traceback" not in output
    last = result.stderr.rstrip().splitlines()[-1]
    assert last == f"error: job.dump_folder: nothing can be written in {disk}/run (No space left on device)"


@pytest.mark.parametrize("command", [["./run_train.sh", "--help"], ["./run_train.sh", "--training.steps", "3", "-h"]])
def test_help_lists_the_environment_and_every_option(command):
    """``./run_train.sh --help`` prints the environment the script reads and every config option,
    exit 0 (it was "error: 'help' must be a [section] table")."""
    result = subprocess.run(command, cwd=REPO, env=script_env(2), capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("Trains with torchrun. Environment:\n  NGPU ")
    assert "  MAX_RESTARTS " in result.stdout and "  COMM_MODE " in result.stdout
    assert "  --training.steps int (default: 100)\n      Optimizer steps to train." in result.stdout
