"""An elastic job (run_train.sh with NNODES=1:2): two torchrun agents on this host as two nodes of 2
ranks. One node is killed mid-run; the other goes on alone from the newest checkpoint at half the
data-parallel degree and twice the gradient accumulation, the same global batch: every sample is read
once, and the losses are those of a run started at 2 ranks from that checkpoint. Then the bad inputs
of a node range, one line each."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from config.errors import ConfigError
from config.manager import load_config
from programs.preflight import check_elastic
from tests.launch import (
    REPO,
    TINY_RUN,
    TWO_BLOCKS,
    kill_tree,
    launch_train,
    losses_by_step,
    read_metrics,
    resumed_from,
    run_script,
    script_command,
    script_env,
)
from trainer.checkpoint.integrity import complete_checkpoints

RECORDER = os.path.join("tests", "distributed", "record_attempt_samples.py")
STEPS = 12
LOCAL_BATCH = 2
GLOBAL_BATCH = 4 * LOCAL_BATCH  # 2 nodes x 2 ranks, training.global_batch_size unset
LOSS_RTOL = 1e-5
CONFIG = ["--job.config_file", "configs/debug_model.toml"]  # run_train.sh's; the reference's too
OPTIONS = [
    *TWO_BLOCKS,
    *("--training.steps", str(STEPS), "--training.local_batch_size", str(LOCAL_BATCH)),
    *("--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"),
]
RUN = [*CONFIG, *TINY_RUN, *OPTIONS]
# torchrun's c10d rendezvous, quick for a test on one host (the defaults suit clusters: a dead node is
# noticed after 3 missed heartbeats 5 s apart, and a round waits 30 s for late nodes once MIN have joined).
RDZV_CONF = "keep_alive_interval=2,keep_alive_max_attempt=5,last_call_timeout=3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recording_python(folder: Path) -> str:
    """An interpreter for run_train.sh's PYTHON that runs RECORDER in place of train.py."""
    wrapper = folder / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        "args=()\n"
        f'for arg in "$@"; do [ "$arg" = {REPO}/train.py ] && arg={REPO}/{RECORDER}; args+=("$arg"); done\n'
        f'exec {sys.executable} "${{args[@]}}"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def _node(dump: str, port: int, python: str, log: Path, hosts_store: bool) -> subprocess.Popen:
    env = {
        **script_env(2),
        "NNODES": "1:2",
        "RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "RDZV_ID": "elastic",
        "MAX_RESTARTS": "1",
        "PYTHON": python,
        # torchrun reads its options from PET_ variables too. The first node hosts the rendezvous
        # store: the node killed is the other (torchrun's store dies with the node hosting it).
        "PET_RDZV_CONF": f"is_host={int(hosts_store)},{RDZV_CONF}",
    }
    with open(log, "w") as out:
        return subprocess.Popen(script_command(dump, *RUN), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def _logged_steps(dump: str) -> int:
    metrics = os.path.join(dump, "metrics.jsonl")
    return sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0


def _rows(dump: str, attempt: int, rank: int, lines: int | None = None) -> list[tuple[int, ...]]:
    """The input rows of the first ``lines`` batches (all: None) of an attempt's rank."""
    with open(os.path.join(dump, f"samples-attempt{attempt}-rank{rank}.jsonl")) as f:
        batches = [json.loads(line) for line in f][:lines]
    return [tuple(row) for batch in batches for row in batch]


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory) -> tuple[str, str, str]:
    """The elastic job, one node killed once step 4 is logged and checkpointed: (dump folder, the
    surviving node's output, the killed node's)."""
    root = tmp_path_factory.mktemp("elastic")
    dump, python, port = str(root / "dump"), _recording_python(root), _free_port()
    survivor = _node(dump, port, python, root / "survivor.log", hosts_store=True)
    lost = _node(dump, port, python, root / "lost.log", hosts_store=False)
    try:
        deadline = time.monotonic() + 600
        while _logged_steps(dump) < 4 or not complete_checkpoints(os.path.join(dump, "checkpoint")):
            assert survivor.poll() is None and lost.poll() is None, (root / "survivor.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step 4 within 600 s"
            time.sleep(0.05)
        kill_tree(lost)
        assert survivor.wait(timeout=600) == 0, (root / "survivor.log").read_text()[-4000:]
    finally:
        for node in (survivor, lost):
            if node.poll() is None:
                kill_tree(node)
    return dump, (root / "survivor.log").read_text(), (root / "lost.log").read_text()


@pytest.mark.slow  # launches torchrun
def test_a_lost_node_leaves_the_other_going_on_at_the_same_global_batch(shrunk, tmp_path):
    dump, output, _ = shrunk
    [step] = resumed_from(output)
    assert step >= 2 and step % 2 == 0, output[-4000:]
    line = f"world 4 -> 2 ranks (from checkpoint step {step}): dp 4 -> 2, gradient accumulation 1 -> 2, global batch 8"
    assert output.count(line) == 1, output[-4000:]

    # The reference: the smaller layout from that checkpoint on, started by hand.
    reference = str(tmp_path / "reference")
    shutil.copytree(
        os.path.join(dump, "checkpoint", f"step-{step}"), os.path.join(reference, "checkpoint", f"step-{step}")
    )
    launch_train(reference, 2, *CONFIG, *OPTIONS, script=RECORDER)
    expected = losses_by_step(read_metrics(reference))
    assert sorted(expected) == list(range(step + 1, STEPS + 1))
    losses = losses_by_step(read_metrics(dump))
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s, loss in expected.items():
        assert abs(losses[s] - loss) <= LOSS_RTOL * abs(loss), (s, losses[s], loss)

    # Every sample of the run once: the 4 ranks' batches up to the checkpoint (one per step each),
    # then the 2 ranks' (two per step each), which are the reference's.
    before = [row for rank in range(4) for row in _rows(dump, 0, rank, lines=step)]
    after = [row for rank in range(2) for row in _rows(dump, 1, rank)]
    read = Counter(before + after)
    assert len(read) == STEPS * GLOBAL_BATCH and set(read.values()) == {1}
    assert Counter(after) == Counter(row for rank in range(2) for row in _rows(reference, 0, rank))


def _script_error(env: dict[str, str]) -> tuple[int, list[str]]:
    result = subprocess.run(
        script_command("/nonexistent"), cwd=REPO, env=script_env(2, env), capture_output=True, text=True, timeout=60
    )
    return result.returncode, result.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "env, line",
    [
        ({"NNODES": "3:2"}, "error: NNODES: '3:2': MIN 3 is above MAX 2"),
        ({"NNODES": "0:2"}, "error: NNODES: '0:2': a job has 1 node or more"),
        ({"NNODES": "1:two"}, "error: NNODES: '1:two' is not a number of nodes"),
        ({"NNODES": "1:2"}, "error: RDZV_ENDPOINT: set it to host:port of the first node for a job of 1:2 nodes"),
    ],
)
def test_a_bad_node_range_is_one_line(env, line):
    assert _script_error(env) == (2, [line])


@pytest.mark.slow  # launches run_train.sh
def test_a_global_batch_the_ranks_left_cannot_keep_is_one_line(shrunk, tmp_path):
    """The finished run's checkpoints (saved at 2 ranks, global batch 8) resumed at 3 ranks of 2
    sequences: 8 is not a whole number of their batches of 6. The ranks refuse it in one line naming
    the option, without a traceback or a restart."""
    dump = str(tmp_path / "run")
    shutil.copytree(shrunk[0], dump)
    result = run_script(dump, *RUN, nproc=3, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-4000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: training.global_batch_size: the run's global batch of 8 sequences (checkpoint step-{STEPS}, "
        "saved at 2 ranks) cannot be kept at 3 ranks: it is not divisible by training.local_batch_size 2 x "
        "data-parallel degree 3; set training.global_batch_size to a multiple of that"
    ), output[-4000:]
    assert "Traceback" not in output and "Restarting" not in output


def _elastic_error(nodes: range, *options: str) -> str | None:
    """check_elastic's line for a job of ``nodes`` nodes of 2 ranks with ``options``, None when it passes."""
    try:
        check_elastic(load_config(["--training.local_batch_size", "2", *options]), nodes, 2)
    except ConfigError as e:
        return str(e)
    return None


def test_the_node_range_is_checked_before_the_launch():
    """At each node count of the range: the model split divides the world, and the global batch the
    job starts with at MAX (set, or the default) is a whole number of microbatches."""
    assert _elastic_error(range(1, 3)) is None  # 8 at 2 nodes, 2 microbatches of 4 at 1
    assert _elastic_error(range(1, 3), "--parallelism.data_parallel_shard_degree", "4") is None  # re-derived at 1
    assert _elastic_error(range(1, 3), "--parallelism.tensor_parallel_degree", "4") == (
        "parallelism: tensor 4 x context 1 x pipeline 1 degrees = 4 do not divide a world of 2 ranks "
        "(at NNODES=1 of 1:2)"
    )
    assert _elastic_error(range(2, 4)) == (
        "training.global_batch_size: 12 sequences per step (at NNODES=3) cannot be kept at NNODES=2 of 2:3: "
        "training.local_batch_size x data-parallel degree there is 8; set training.global_batch_size to a multiple "
        "of it"
    )
    assert _elastic_error(range(2, 4), "--training.global_batch_size", "24") is None
