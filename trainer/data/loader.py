"""The data loaders the trainer and the validator read: each corpus of a section prepared into token shards
(once, cached), read as one global stream of packed windows (a weighted mixture when there are several)."""

from __future__ import annotations

import dataclasses
import os

from torchdata.stateful_dataloader import StatefulDataLoader

from config.errors import user_input
from config.job_config import Training, Validation
from parallelisms.parallel_dims import ParallelDims
from trainer.data.corpus import Corpus, corpus_of
from trainer.data.mixture import PackedTokenDataset, packed_dataloader, windows_in
from trainer.data.shards import encoder_for, prepare_tokens
from trainer.data.tokenizer import Tokenizer


def section_corpora(section: Training | Validation) -> tuple[list[Corpus], list[float]]:
    """The corpora of ``section`` and their weights: training.datasets at training.dataset_weights (equal
    when empty), else the section's one dataset."""
    names = getattr(section, "datasets", [])
    if not names:
        return [corpus_of(section)], [1.0]
    corpora = [corpus_of(dataclasses.replace(section, dataset=name)) for name in names]
    return corpora, list(section.dataset_weights) or [1.0] * len(corpora)


def config_dataloader(
    option: str,
    section: Training | Validation,
    training: Training,
    tokenizer: Tokenizer,
    parallel_dims: ParallelDims,
    *,
    seed: int,
    cache_dir: str,
    document_masking: bool = False,
    replica: tuple[int, int] = (0, 1),
) -> StatefulDataLoader:
    """This DP rank's loader of ``section``'s corpora, yielding ``Batch``; validation takes training's shape
    where it sets none. ``replica``: (this replica group, the groups), which split the data first."""
    corpora, weights = section_corpora(section)
    if len(corpora) > 1:
        option = f"{option.partition('.')[0]}.datasets"
    seq_len = section.seq_len or training.seq_len
    with user_input(option):
        encoder = encoder_for(section, training, tokenizer)
        sources = []
        for corpus in corpora:
            source = prepare_tokens(corpus, encoder, cache_dir, workers=_prepare_workers_per_rank(training))
            try:
                windows_in(source, seq_len)
            except ValueError as error:
                raise ValueError(f"dataset {corpus.dataset}: {error}") from None
            sources.append(source)
        dataset = PackedTokenDataset(
            sources,
            weights=weights,
            seq_len=seq_len,
            local_batch_size=section.local_batch_size or training.local_batch_size,
            dp_rank=replica[0] * parallel_dims.dp_degree + parallel_dims.dp_rank,
            dp_world_size=replica[1] * parallel_dims.dp_degree,
            seed=seed,
            document_masking=document_masking,
        )
        return packed_dataloader(dataset, num_workers=training.dataloader_num_workers)


def _prepare_workers_per_rank(training: Training) -> int:
    """The node's preparation processes divided among its ranks, which share the shards between them."""
    per_node = training.dataset_prepare_workers or len(os.sched_getaffinity(0))
    return max(1, per_node // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
