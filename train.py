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


def exit_without_teardown(code: int) -> None:
    """Ends the process without Python finalization or C++ destructors: tearing down gloo's
    connections at exit sometimes aborts a rank (std::terminate) after a finished run, which
    torchrun would report as a failed job. Every rank has passed the final barrier by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Helper processes (async checkpointing, dataloader workers) re-import this file: keep work here.
if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))
