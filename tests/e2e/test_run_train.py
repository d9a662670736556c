"""run_train.sh end to end: 2 CPU ranks, the default corpus and tokenizer, real output files."""

import os
import subprocess
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch import REPO, losses, read_metrics

METRIC_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"}


def test_run_train_30_steps(tmp_path):
    dump = str(tmp_path / "run")
    env = dict(os.environ, NGPU="2", PYTHON=sys.executable)
    result = subprocess.run(
        [
            "./run_train.sh",
            "--training.steps", "30",
            "--training.seq_len", "128",
            "--job.dump_folder", dump,
            "--job.run_name", "e2e",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]

    records = read_metrics(dump)
    assert [r["step"] for r in records] == [1, 10, 20, 30]
    for record in records:
        assert METRIC_KEYS <= set(record)
        assert record["tps"] > 0 and record["memory_gib"] > 0
    assert losses(records)[-1] < 0.9 * losses(records)[0]

    events = EventAccumulator(os.path.join(dump, "tb", "e2e"))
    events.Reload()
    loss_events = events.Scalars("loss/global_avg")
    assert [e.step for e in loss_events] == [1, 10, 20, 30]
    # TensorBoard stores float32.
    assert [e.value for e in loss_events] == [float(np.float32(r["loss"])) for r in records]

    assert os.path.isfile(os.path.join(dump, "config.toml"))
    # Rank 0's console line carries the step's metrics.
    assert "step 30" in result.stdout + result.stderr
