"""A run on local Parquet shards (written here, read through the ``datasets`` library) stopped on 2
data-parallel ranks and resumed on 1 at the same global batch: every sample is read exactly once
(counted row by row), and the losses are those of an uninterrupted run. A bad shard through
``run_train.sh`` is one line before any rank starts."""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.launch import launch_train, losses_by_step, read_metrics, resumed_from, run_script

pytestmark = pytest.mark.slow  # launches torchrun and run_train.sh

RECORD_SAMPLES = os.path.join("tests", "distributed", "record_samples.py")
STEPS = 4
# Global batch 4 throughout; 4 steps read 16 windows, fewer than the corpus has, so no sample
# would come round again in a second epoch: any repeat is a bug.
ONE_RANK = ["--training.local_batch_size", "4"]
TWO_RANKS = ["--training.local_batch_size", "2"]
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "2"]
# Loss relative tolerance between 2 ranks and 1 process: reduction orders differ (see
# test_checkpoint_layouts); a lost or repeated sample changes a loss by far more.
LOSS_RTOL = 1e-5


def write_shards(folder: Path, *, shards: int, documents: int, seed: int) -> Path:
    """Parquet shards of distinct documents (random words, numbered), text in 'body'."""
    rng = random.Random(seed)
    words = "the of a model data shard token batch rank step loss sample window parquet arrow".split()
    folder.mkdir(parents=True)
    for shard in range(shards):
        texts = [
            f"document {seed}.{shard}.{i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            for i in range(documents)
        ]
        pq.write_table(pa.table({"id": list(range(documents)), "body": texts}), folder / f"part-{shard:05d}.parquet")
    return folder


def recorded_rows(dump: str) -> list[tuple[int, ...]]:
    """Every input row the run's ranks trained on (all launches, all ranks)."""
    rows = []
    for name in sorted(os.listdir(dump)):
        if name.startswith("samples-rank"):
            with open(os.path.join(dump, name)) as f:
                rows += [tuple(row) for line in f for row in json.loads(line)]
    return rows


def test_resumed_at_another_data_parallel_degree_reads_every_sample_once(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "train", shards=3, documents=20, seed=0)
    held_out = write_shards(tmp_path / "validation", shards=1, documents=10, seed=1)
    data = [
        *("--training.dataset", str(shards), "--training.dataset_text_field", "body"),
        *("--validation.enable", "--validation.freq", "2", "--validation.steps", "1"),
        *("--validation.dataset", str(held_out), "--validation.dataset_text_field", "body"),
        *("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"),  # a schedule that fits 2 steps
    ]
    steps = ["--training.steps", str(STEPS)]
    whole = str(tmp_path / "whole")
    launch_train(whole, 1, *data, *steps, *ONE_RANK, script=RECORD_SAMPLES)
    uninterrupted = losses_by_step(read_metrics(whole))

    dump = str(tmp_path / "resumed")
    launch_train(dump, 2, *data, "--training.steps", str(STEPS // 2), *TWO_RANKS, *CHECKPOINTS, script=RECORD_SAMPLES)
    result = launch_train(dump, 1, *data, *steps, *ONE_RANK, *CHECKPOINTS, script=RECORD_SAMPLES)
    assert resumed_from(result.stdout + result.stderr) == [STEPS // 2], result.stderr[-3000:]

    expected = recorded_rows(whole)
    assert len(expected) == STEPS * 4 and len(set(expected)) == len(expected)
    read = Counter(recorded_rows(dump))
    assert sum(read.values()) == STEPS * 4 and set(read.values()) == {1}  # no sample twice
    assert set(read) == set(expected)  # none lost
    resumed = losses_by_step(read_metrics(dump))
    assert resumed.keys() == uninterrupted.keys() == set(range(1, STEPS + 1))
    for step, loss in uninterrupted.items():
        assert abs(resumed[step] - loss) <= LOSS_RTOL * abs(loss), (step, resumed[step], loss)
    with open(os.path.join(whole, "validation.jsonl")) as f:
        assert len(f.readlines()) == 1 + STEPS // 2  # the held-out shards were validated on


def test_bad_shard_through_run_train_sh(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "train", shards=2, documents=2, seed=0)
    (shards / "part-00001.parquet").write_bytes(b"PAR1 cut short")
    dataset = ["--training.dataset", str(shards), "--training.dataset_text_field", "body"]
    result = run_script(str(tmp_path / "dump"), *dataset, check=False, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"error: training.dataset: {shards / 'part-00001.parquet'}: unreadable parquet file (")
    assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "dump" / "metrics.jsonl")
