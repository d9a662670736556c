"""Checks a job's config for a given world size in one process, before torchrun starts them all.

``python -m trainer.preflight --world-size N [config options]``: exits 2 with one line on stderr
when the config is wrong.
"""

from __future__ import annotations

import os
import sys

from config.job_config import ConfigError
from config.manager import batch_layout, load_config
from models.builder import model_args
from models.registry import get_model_spec
from trainer.distributed import parallel_dims_from_config


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
