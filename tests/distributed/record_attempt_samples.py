"""record_samples.py's run with each of torchrun's attempts on a node writing files of its own,
``<dump_folder>/samples-attempt<A>-rank<R>.jsonl`` (A: the node's TORCHELASTIC_RESTART_COUNT), so that
the batches of an attempt cut short can be told from those of the next.

Usage: torchrun --nproc-per-node N tests/distributed/record_attempt_samples.py <train.py arguments>
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from config.manager import load_config
from tests.distributed.record_samples import RecordingLoader
from train import exit_without_teardown
from trainer.trainer import Trainer


def main(argv: list[str]) -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(levelname)s %(message)s")
    config = load_config(argv)
    trainer = Trainer(config)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = os.path.join(config.job.dump_folder, f"samples-attempt{attempt}-rank{dist.get_rank()}.jsonl")
    trainer.dataloader = RecordingLoader(trainer.dataloader, path)
    trainer.train()
    trainer.close()
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1:])
