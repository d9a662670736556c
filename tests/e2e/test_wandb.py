"""metrics.enable_wandb (torchtitan's option): a run logs to Weights & Biases what it logs to
TensorBoard, read back here from the run file W&B writes in offline mode (no network); a host that
cannot start W&B runs gets one line before launch.

W&B's run file is a log of 32 KiB blocks (a 7-byte header, then records of a 4-byte checksum, a
2-byte length, a 1-byte type: whole, first, middle or last piece) holding W&B's protobuf records.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from tests.launch import REPO, launch_train, read_metrics

pytestmark = pytest.mark.slow  # launches train.py

wandb_internal = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK, HEADER, RECORD_HEADER = 32768, 7, 7
WHOLE, FIRST, LAST = 1, 2, 4


def wandb_records(path: str) -> list:
    """The protobuf records of a W&B run file."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:8]
    records, pos, pending = [], HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # a block's tail too short for a record is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        piece = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        pending = piece if kind in (WHOLE, FIRST) else pending + piece
        if kind in (WHOLE, LAST):
            record = wandb_internal.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_file: str) -> dict[int, dict[str, float]]:
    """Each logged step's values by W&B key (``loss/global_avg``, ...), without W&B's own."""
    history = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {key: value for key, value in items.items() if not key.startswith("_")}
    return history


def test_a_run_logs_its_metrics_to_wandb(tmp_path):
    dump = str(tmp_path / "run")
    result = launch_train(
        dump,
        1,
        *("--training.steps", "4", "--metrics.enable_wandb", "--job.run_name", "wandb-check"),
        *("--validation.enable", "--validation.freq", "2", "--validation.steps", "1"),
        env={"WANDB_MODE": "offline"},
    )
    (run_file,) = glob.glob(os.path.join(dump, "wandb", "offline-run-*", "run-*.wandb"))
    assert f"wandb       {os.path.dirname(run_file)}" in result.stderr
    history = wandb_history(run_file)
    assert sorted(history) == [1, 2, 3, 4]
    for record in read_metrics(dump):
        logged = history[record["step"]]
        assert logged["loss/global_avg"] == record["loss"] and logged["grad_norm"] == record["grad_norm"]
        assert logged["lr"] == record["lr"] and logged["throughput/tps"] == record["tps"]
    with open(os.path.join(dump, "validation.jsonl")) as f:
        validation = [json.loads(line) for line in f]
    assert [history[v["step"]]["validation/loss"] for v in validation] == [v["loss"] for v in validation]
    (run,) = [r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "wandb-check"
    training = next(json.loads(u.value_json) for u in run.config.update if u.key == "training")
    assert training["steps"] == 4  # the run's resolved config


def preflight(env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "programs.preflight", "--world-size", "1", "--metrics.enable_wandb"]
    command += ["--job.dump_folder", str(tmp_path / "run")]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_no_api_key_is_one_line_before_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    result = preflight(dict(env, HOME=str(tmp_path), PYTHONPATH=REPO), tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: metrics.enable_wandb: No API key configured")
    assert "WANDB_MODE=offline" in result.stderr and "Traceback" not in result.stderr


def test_no_wandb_package_is_one_line_before_launch(tmp_path):
    missing = tmp_path / "site" / "wandb"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('no wandb here')\n")
    result = preflight(dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}:{REPO}"), tmp_path)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        == "error: metrics.enable_wandb: the wandb package is not installed here (pip install wandb)"
    )


@pytest.mark.parametrize(
    ("variables", "refused"),
    [
        ({"WANDB_MODE": "ofline"}, "mode='ofline': Input should be 'online', 'offline'"),
        ({"WANDB_MODE": "offline", "WANDB_SILENT": "perhaps"}, "silent='perhaps': Input should be a valid boolean"),
    ],
)
def test_a_wandb_variable_wandb_does_not_take_is_one_line_before_launch(tmp_path, variables, refused):
    """A mistyped WANDB_MODE was a traceback of W&B's settings before launch; with WANDB_MODE=offline
    another bad variable passed, and the ranks trained without a W&B run after a warning."""
    result = preflight(dict(os.environ, PYTHONPATH=REPO, **variables), tmp_path)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"error: metrics.enable_wandb: W&B refuses its WANDB_* settings ({refused}")
    assert "\n" not in line
