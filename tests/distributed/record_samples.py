"""torchrun worker: train.py's run (the same Trainer, config and output files), also appending each
batch this rank trains on to ``<dump_folder>/samples-rank<R>.jsonl``: one line per batch, its input
rows as lists of token ids (from a mixture of corpora, ``[source, row]``). The checkpoint still saves
the real loader's position; only iteration goes through the recorder.

Usage: torchrun --nproc-per-node N tests/distributed/record_samples.py <train.py arguments>
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator

import torch.distributed as dist

from config.manager import load_config
from train import exit_without_teardown
from trainer.trainer import Trainer


class RecordingLoader:
    """Iterates ``loader`` and writes every Batch's inputs to ``path`` as it hands the batch on."""

    def __init__(self, loader: Iterable, path: str):
        self.loader = loader
        self.path = path

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            rows = batch.inputs.tolist()
            if batch.sources is not None:
                rows = [[source, row] for source, row in zip(batch.sources.tolist(), rows)]
            with open(self.path, "a") as f:
                f.write(json.dumps(rows) + "\n")
            yield batch


def main(argv: list[str], file_prefix: str = "samples-") -> None:
    """Trains as train.py does, this rank's batches written to <dump_folder>/<file_prefix>rank<R>.jsonl."""
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(levelname)s %(message)s")
    config = load_config(argv)
    trainer = Trainer(config)
    path = os.path.join(config.job.dump_folder, f"{file_prefix}rank{dist.get_rank()}.jsonl")
    trainer.dataloader = RecordingLoader(trainer.dataloader, path)
    trainer.train()
    trainer.close()
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1:])
