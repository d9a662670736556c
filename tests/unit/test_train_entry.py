"""train.py's sorting of a failed run's errors: a peer's death or hang is one line and a restart,
anything else a traceback; a refusal posted by another node ends this one too."""

import errno
import threading

import pytest
import torch.distributed as dist

import train
import trainer.trainer
from train import _is_collective_failure, _peer_refused
from trainer.distributed import REFUSAL_KEY


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


def test_a_refusal_posted_a_moment_after_the_collective_broke_is_found(tmp_path, monkeypatch):
    """An agent posts the line of a rank the kernel killed a moment after the peers' collectives
    broke (its monitor polls): a peer waits a second for it, copies it to its node's error file and
    ends, where it would have exited 1 and been restarted."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    error_file = tmp_path / "error"
    error_file.write_text("")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TESSERA_ERROR_FILE", str(error_file))
    assert not _peer_refused()  # nothing posted: a rank died, the job restarts
    line = "2 error: training.local_batch_size: the kernel's out-of-memory killer ended rank 1\n"
    agent = threading.Timer(0.3, store.set, args=(REFUSAL_KEY, line))  # another node's agent
    agent.start()
    try:
        assert _peer_refused()
    finally:
        agent.join()
    assert error_file.read_text() == line


def test_a_full_disk_in_the_ranks_is_a_refusal_not_a_traceback(monkeypatch, capsys):
    """A disk that fills while a rank writes (metrics, TensorBoard) is one line naming the file,
    exit 2: a restart would meet the same disk (a traceback and a restart before)."""

    def write_on_a_full_disk(config):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    monkeypatch.setattr(trainer.trainer, "Trainer", write_on_a_full_disk)
    monkeypatch.delenv("TESSERA_ERROR_FILE", raising=False)
    assert train.main(["--training.steps", "1"]) == 2
    assert capsys.readouterr().err == "error: job.dump_folder: /data/run/metrics.jsonl: No space left on device\n"

    def other_os_error(config):
        raise OSError(errno.EACCES, "Permission denied", "/data/run/metrics.jsonl")

    monkeypatch.setattr(trainer.trainer, "Trainer", other_os_error)
    with pytest.raises(PermissionError):
        train.main(["--training.steps", "1"])
