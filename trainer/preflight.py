"""Checks a job's config for a given world size in one process, before torchrun starts them all.

``python -m trainer.preflight --world-size N [config options]``: exits 2 with one line on stderr
when the config is wrong.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from models.registry import get_flavor, get_model_spec
from trainer.config import ConfigError, batch_layout, load_config
from trainer.distributed import ParallelDims


def check(argv: list[str], world_size: int) -> None:
    config = load_config(argv)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    batch_layout(config.training, dims.dp_degree)
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {world_size}")
    if ckpt.initial_load_path and not os.path.isdir(ckpt.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: {ckpt.initial_load_path} is not a folder")
    spec = get_model_spec(config.model.name)
    model_args = get_flavor(spec, config.model.flavor)
    if dims.tp_enabled:
        from parallelisms.tensor_parallel import validate_tp

        with torch.device("meta"):
            model = spec.model_cls(dataclasses.replace(model_args, max_seq_len=config.training.seq_len))
        validate_tp(model, dims.tp)
    if dims.pp_enabled:
        # Imported here: the trainer's imports would double the start-up of every other check.
        from trainer.trainer import pipeline_layout

        pipeline_layout(config, model_args.n_layers)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--world-size" or not argv[1].isdigit():
        print("usage: python -m trainer.preflight --world-size N [config options]", file=sys.stderr)
        return 2
    try:
        check(argv[2:], int(argv[1]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
