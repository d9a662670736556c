"""``python -m programs.prepare_data [config options]``: tokenizes a job's corpora into token shards
ahead of training, with the tokenizer and data format the run uses, so that the run finds them
prepared: training's (``training.datasets``, else ``training.dataset``) and, when enabled,
validation's. Prints each corpus's folder, documents, tokens, MB/s and time; bad input is one line on
stderr and exit 2. Several nodes sharing ``job.cache_dir`` may run it at once: they split the shards."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator

from config.errors import ConfigError, print_error, user_input
from config.job_config import JobConfig, Training, Validation
from config.manager import help_text, load_config, named_as_given
from trainer.data.corpus import Corpus, corpus_of, pin_revision
from trainer.data.shards import INDEX_FILE, ShardedTokens, encoder_for, prepare_tokens, token_folder
from trainer.data.tokenizer import build_tokenizer


def job_corpora(config: JobConfig) -> Iterator[tuple[str, Training | Validation, Corpus]]:
    """(option, section, corpus) of each corpus the job reads."""
    training = config.training
    if training.datasets:
        for name in training.datasets:
            yield "training.datasets", training, corpus_of(dataclasses.replace(training, dataset=name))
    else:
        yield "training.dataset", training, corpus_of(training)
    if config.validation.enable:
        yield "validation.dataset", config.validation, corpus_of(config.validation)


def prepare_job_data(config: JobConfig) -> Iterator[tuple[str, ShardedTokens, float, bool]]:
    """Prepares the job's corpora in turn: (option, shards, seconds, whether made now) of each."""
    with user_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(
            config.model.tokenizer_path, config.job.cache_dir, config.model.default_tokenizer_vocab_size
        )
    for option, section, corpus in job_corpora(config):
        with user_input(option):
            encoder = encoder_for(section, config.training, tokenizer)
            start = time.perf_counter()
            corpus = pin_revision(corpus)
            ready = os.path.exists(os.path.join(token_folder(corpus, encoder, config.job.cache_dir), INDEX_FILE))
            workers = config.training.dataset_prepare_workers
            tokens = prepare_tokens(corpus, encoder, config.job.cache_dir, workers=workers)
        yield f"{option} {corpus.dataset}", tokens, time.perf_counter() - start, not ready


def describe(name: str, tokens: ShardedTokens, seconds: float, made: bool) -> str:
    counts = f"{tokens.num_documents:,} documents, {tokens.num_tokens:,} tokens"
    if not made:
        return f"{name}: {tokens.folder}: {counts} (prepared before)"
    rate = tokens.num_bytes / 1e6 / seconds
    return f"{name}: {tokens.folder}: {counts}, {tokens.num_bytes / 1e6:,.1f} MB at {rate:,.1f} MB/s in {seconds:.1f}s"


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text("python -m programs.prepare_data"))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        config = load_config(argv)
        for name, tokens, seconds, made in prepare_job_data(config):
            print(describe(name, tokens, seconds, made), flush=True)
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
