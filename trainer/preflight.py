"""Checks a job's config for a given world size in one process, before torchrun starts them all.

``python -m trainer.preflight --world-size N [config options]``: exits 2 with one line on stderr
when the config is wrong.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from config.job_config import ConfigError, JobConfig
from config.manager import batch_layout, load_config
from models.builder import model_args
from models.registry import get_model_spec
from trainer.corpus import DEFAULT_DATASET, local_corpus_texts
from trainer.distributed import parallel_dims_from_config
from trainer.hf_checkpoint import check_hf_config, is_hf_folder
from trainer.optim import build_optimizer_and_schedule
from trainer.tokenizer import build_tokenizer

# Dataset names torchtitan downloads; Tessera reads local files only.
_TORCHTITAN_DATASETS = {"c4", "c4_test", "c4_validation"}


def check(argv: list[str], world_size: int) -> None:
    config = load_config(argv)
    dims = parallel_dims_from_config(config.parallelism, world_size)
    batch_layout(config.training, dims.dp_degree)
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {world_size}")
    if ckpt.initial_load_path and not os.path.isdir(ckpt.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: {ckpt.initial_load_path} is not a folder")
    get_model_spec(config.model.name).check_layout_fn(model_args(config), dims, config)
    build_optimizer_and_schedule(config, [torch.nn.Linear(1, 1)])
    check_files(config)


def check_files(config: JobConfig) -> None:
    """Reads the start of every corpus, the tokenizer and the Hugging Face folder the run will
    use; one line names every one that is missing or broken."""
    options = ["training.dataset"] + (["validation.dataset"] if config.validation.enable else [])
    problems = [problem for option in options if (problem := _dataset_problem(config, option))]
    vocab_size = None
    if config.model.tokenizer_path:  # the default one is trained on first use: nothing to read yet
        try:
            vocab_size = build_tokenizer(config.model.tokenizer_path, config.job.cache_dir).vocab_size
        except (ValueError, OSError) as e:
            problems.append(f"model.tokenizer_path: {e}")
    if vocab_size is not None:
        model_args(config, vocab_size)  # says when the tokenizer's vocabulary replaces the flavor's
    path = config.checkpoint.initial_load_path
    if path and is_hf_folder(path) and vocab_size is not None:
        try:
            check_hf_config(path, model_args(config, vocab_size))
        except ValueError as e:
            problems.append(f"checkpoint.initial_load_path: {e}")
    if problems:
        raise ConfigError("; ".join(problems))


def _dataset_problem(config: JobConfig, option: str) -> str | None:
    section, _, name = option.partition(".")
    dataset = getattr(getattr(config, section), name)
    if dataset == DEFAULT_DATASET:
        return None
    try:
        next(local_corpus_texts(dataset), None)
    except (ValueError, OSError) as e:
        hint = ""
        if dataset in _TORCHTITAN_DATASETS:
            hint = f" ('{dataset}' is a dataset torchtitan downloads; give a local .txt/.jsonl with --{option}_path)"
        return f"{option}: {e}{hint}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--world-size" or not argv[1].isdigit():
        print("usage: python -m trainer.preflight --world-size N [config options]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        check(argv[2:], int(argv[1]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
