"""torchrun worker: train.py's Trainer on windows of packed documents built here, as the loader
hands them (``Batch``: labels at document ends ignored, positions restarting per document under
document masking), so that every parallel layout trains on the same global batches.

Usage: torchrun --nproc-per-node N tests/distributed/document_masking_run.py <train.py arguments>
[--- <train.py arguments> ...]: several runs in the same processes, one after the other. Each run
writes its metrics.jsonl as train.py does; rank 0 also writes ``reference.json`` in its dump folder:
step 1's loss and gradient norm computed on one process from each document run alone (the loss a
packed window must reproduce), and ``plain_loss``, step 1's loss of the causal model over whole
windows (what a run without masking must give).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import trainer.trainer as trainer_module
from config.manager import load_config
from models.llama3 import Transformer
from train import exit_without_teardown
from trainer.data.batch import IGNORE_INDEX, Batch
from trainer.loss import summed_cross_entropy
from trainer.trainer import Trainer

SHORTEST, LONGEST = 5, 40  # document lengths, in tokens


def global_batch(step: int, windows: int, seq_len: int, vocab_size: int) -> list[list[torch.Tensor]]:
    """Step ``step``'s windows, each a list of documents filling seq_len + 1 tokens exactly (the last
    one cut short, as a window cuts the stream)."""
    generator = torch.Generator().manual_seed(1000 + step)
    batch = []
    for _ in range(windows):
        docs, left = [], seq_len + 1
        while left > 0:
            length = min(left, int(torch.randint(SHORTEST, LONGEST, (1,), generator=generator)))
            docs.append(torch.randint(0, vocab_size, (length,), generator=generator))
            left -= length
        batch.append(docs)
    return batch


def window_batch(docs: list[torch.Tensor], masking: bool) -> Batch:
    """One window as the loader yields it (a batch of one)."""
    tokens = torch.cat(docs)
    inputs, labels = tokens[:-1].clone(), tokens[1:].clone()
    if not masking:
        return Batch(inputs[None], labels[None])
    lengths = torch.tensor([len(doc) for doc in docs])
    starts = lengths.cumsum(0)[:-1]
    labels[starts - 1] = IGNORE_INDEX  # the next document's first token is not predicted
    positions = torch.cat([torch.arange(len(doc)) for doc in docs])[:-1]
    return Batch(inputs[None], labels[None], positions[None])


def stack(batches: list[Batch], sources: torch.Tensor | None = None) -> Batch:
    positions = None if batches[0].positions is None else torch.cat([b.positions for b in batches])
    return Batch(torch.cat([b.inputs for b in batches]), torch.cat([b.labels for b in batches]), positions, sources)


def window_sources(windows: range, num_sources: int) -> torch.Tensor | None:
    """With several corpora, window w comes from source w mod their count."""
    return torch.tensor([w % num_sources for w in windows]) if num_sources > 1 else None


class PackedDocuments:
    """This DP rank's microbatches of each step's global batch (its slice of the windows)."""

    def __init__(self, training, parallel_dims, vocab_size: int, masking: bool):
        self.training, self.dims, self.vocab_size, self.masking = training, parallel_dims, vocab_size, masking

    def __iter__(self):
        local = self.training.local_batch_size
        windows = local * self.dims.dp_degree
        step = 0
        while True:
            step += 1
            batch = global_batch(step, windows, self.training.seq_len, self.vocab_size)
            mine = range(self.dims.dp_rank * local, (self.dims.dp_rank + 1) * local)
            sources = window_sources(mine, len(self.training.datasets))
            yield stack([window_batch(batch[w], self.masking) for w in mine], sources)


def packed_dataloader(
    option, section, training, tokenizer, parallel_dims, *, seed, cache_dir, document_masking=False, replica=(0, 1)
):
    """Stands in for ``config_dataloader`` (same parameters)."""
    return PackedDocuments(training, parallel_dims, tokenizer.vocab_size, document_masking)


def write_reference(trainer: Trainer) -> None:
    """Step 1 on one process: each document alone (the packed windows' target) and whole windows
    through the causal model as the trainer computes it without masking."""
    config = trainer.config
    model = Transformer(trainer.model.args)
    model.init_weights(seed=config.debug.seed)
    windows = trainer.global_batch_size
    batch = global_batch(1, windows, config.training.seq_len, model.args.vocab_size)
    summed, count = torch.zeros(()), 0
    # Every document, the window's last included, trains doc[:-1] -> doc[1:]: the label past a
    # document's end is the next one's first token, ignored.
    for doc in (doc for docs in batch for doc in docs if len(doc) > 1):
        summed = summed + F.cross_entropy(model(doc[None, :-1]).flatten(0, 1), doc[1:], reduction="sum")
        count += len(doc) - 1
    loss = summed / count
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    with torch.no_grad():
        whole = stack([window_batch(docs, masking=False) for docs in batch])
        plain = summed_cross_entropy(model(whole.inputs), whole.labels) / (windows * config.training.seq_len)
    reference = {"loss": loss.item(), "grad_norm": grad_norm.item(), "plain_loss": plain.item()}
    sources = window_sources(range(windows), len(config.training.datasets))
    if sources is not None:
        per_window = [sum(len(doc) - 1 for doc in docs) for docs in batch]
        counts = {name: 0 for name in config.training.datasets}
        for window, source in enumerate(sources.tolist()):
            counts[config.training.datasets[source]] += per_window[window]
        reference["tokens_per_source"] = counts
    with open(os.path.join(config.job.dump_folder, "reference.json"), "w") as f:
        json.dump(reference, f)


def main(argv: list[str]) -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(levelname)s %(message)s")
    trainer_module.config_dataloader = packed_dataloader
    runs = [[]]
    for arg in argv:
        runs.append([]) if arg == "---" else runs[-1].append(arg)
    for args in runs:
        torch._dynamo.reset()
        trainer = Trainer(load_config(args))
        trainer.train()
        if dist.get_rank() == 0:
            write_reference(trainer)
        trainer.close()
        del trainer
        gc.collect()
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1:])
