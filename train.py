"""Entry point: ``torchrun --nproc-per-node N train.py --job.config_file configs/debug_model.toml``."""

from __future__ import annotations

import logging
import os
import sys

from trainer.config import ConfigError, help_text, load_config


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        config = load_config(argv)
        from trainer.trainer import Trainer

        trainer = Trainer(config)
        trainer.train()
        trainer.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


# Helper processes (async checkpointing, dataloader workers) re-import this file: keep work here.
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
