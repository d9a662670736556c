"""train.py's sorting of a failed run's errors: a peer's death or hang is one line and a restart,
anything else a traceback; a refusal posted by another node ends this one too."""

import errno

import pytest
import torch.distributed as dist

import train
import trainer.trainer
from config.errors import ConfigError
from train import _is_collective_failure
from trainer.refusal import ERROR_FILE_ENV, job_refused, refuse


@pytest.mark.parametrize(
    "message",
    [
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer [127.0.0.1]:4321",
        # Seen under load in test_hung_rank_times_out_and_restarts: a wait on a pair that the
        # timeout of another operation had closed.
        "Application timeout caused pair closure",
    ],
)
def test_gloo_failures_are_collective_failures(message):
    assert _is_collective_failure(RuntimeError(message))


def test_other_runtime_errors_are_not():
    assert not _is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"))


def test_a_refusal_on_another_node_reaches_this_nodes_error_file(tmp_path, monkeypatch):
    """A rank of another node refused (its line in torchrun's store) and this node's ranks saw only
    a broken collective: they copy the line to their node's error file and end without a restart."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    this_node, other_node = tmp_path / "this", tmp_path / "other"
    this_node.write_text("")
    other_node.write_text("")
    monkeypatch.setenv(ERROR_FILE_ENV, str(this_node))
    assert not job_refused()  # nothing posted: a rank died, the job restarts
    monkeypatch.setenv(ERROR_FILE_ENV, str(other_node))
    assert refuse(ConfigError("training.local_batch_size: out of memory in step 2 on rank 1")) == 0
    monkeypatch.setenv(ERROR_FILE_ENV, str(this_node))
    assert job_refused()
    assert (
        this_node.read_text()
        == other_node.read_text()
        == ("2 error: training.local_batch_size: out of memory in step 2 on rank 1\n")
    )


def test_a_full_disk_in_the_ranks_is_a_refusal_not_a_traceback(monkeypatch, capsys):
    """A disk that fills while a rank writes (metrics, TensorBoard) is one line naming the file,
    exit 2: a restart would meet the same disk (a traceback and a restart before)."""

    def write_on_a_full_disk(config):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    monkeypatch.setattr(trainer.trainer, "Trainer", write_on_a_full_disk)
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    assert train.main(["--training.steps", "1"]) == 2
    assert capsys.readouterr().err == "error: job.dump_folder: /data/run/metrics.jsonl: No space left on device\n"

    def other_os_error(config):
        raise OSError(errno.EACCES, "Permission denied", "/data/run/metrics.jsonl")

    monkeypatch.setattr(trainer.trainer, "Trainer", other_os_error)
    with pytest.raises(PermissionError):
        train.main(["--training.steps", "1"])
