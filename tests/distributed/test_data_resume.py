"""A run on a mixture of three corpora (token shards, weights 0.5, 0.3, 0.2) stopped on 2 data-parallel
ranks and resumed on 1 and on 4 at the same global batch: every sample is read exactly once (counted row
by row, per source), and the losses are those of an uninterrupted run."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.distributed.test_parquet_resume import LOSS_RTOL, RECORD_SAMPLES, recorded_rows, write_shards
from tests.launch import launch_train, losses_by_step, read_metrics, resumed_from

pytestmark = pytest.mark.slow  # launches torchrun

STEPS = 6
GLOBAL_BATCH = 4
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS // 2)]


def local_batch(ranks: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // ranks)]


def test_a_mixture_stopped_on_2_ranks_resumes_on_1_and_on_4(tmp_path: Path) -> None:
    # Each corpus holds more windows than its share of 24 samples: a repeat would be a bug, not an epoch.
    corpora = [write_shards(tmp_path / f"corpus{i}", shards=2, documents=12, seed=i) for i in range(3)]
    data = [
        *("--training.datasets", ",".join(map(str, corpora)), "--training.dataset_weights", "0.5,0.3,0.2"),
        *("--training.dataset_text_field", "body", "--training.steps", str(STEPS)),
        *("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"),
    ]
    whole = str(tmp_path / "whole")
    launch_train(whole, 1, *data, *local_batch(1), script=RECORD_SAMPLES)
    uninterrupted = losses_by_step(read_metrics(whole))
    expected = recorded_rows(whole)
    assert len(expected) == STEPS * GLOBAL_BATCH
    assert len({tuple(row[1]) for row in expected}) == len(expected)
    assert Counter(source for source, _ in expected) == {0: 12, 1: 7, 2: 5}  # 24 samples at 0.5, 0.3, 0.2

    stopped = str(tmp_path / "stopped")
    halfway = ["--training.steps", str(STEPS // 2)]
    launch_train(stopped, 2, *data, *halfway, *local_batch(2), *CHECKPOINTS, script=RECORD_SAMPLES)
    for ranks in (1, 4):
        dump = str(tmp_path / f"resumed-on-{ranks}")
        shutil.copytree(stopped, dump)
        result = launch_train(dump, ranks, *data, *local_batch(ranks), *CHECKPOINTS, script=RECORD_SAMPLES)
        assert resumed_from(result.stdout + result.stderr) == [STEPS // 2], result.stderr[-3000:]
        read = Counter((source, tuple(row)) for source, row in recorded_rows(dump))
        assert set(read.values()) == {1}, ranks  # no sample twice
        assert set(read) == {(source, tuple(row)) for source, row in expected}, ranks  # none lost
        resumed = losses_by_step(read_metrics(dump))
        assert resumed.keys() == uninterrupted.keys() == set(range(1, STEPS + 1))
        for step, loss in uninterrupted.items():
            assert abs(resumed[step] - loss) <= LOSS_RTOL * abs(loss), (ranks, step, resumed[step], loss)
