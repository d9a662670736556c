"""programs/launch.py (run_train.sh's torchrun): a rank's refusal is the last line and the exit
code; a failed rendezvous is one line, exit 2."""

from __future__ import annotations

import os

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

from programs import launch
from trainer.refusal import ERROR_FILE_ENV

ARGV = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--nproc-per-node=1", "train.py"]


def _raising(error: BaseException):
    def torchrun(argv: list[str]) -> None:
        raise error

    return torchrun


def _connection_error() -> RendezvousConnectionError:
    try:
        try:
            raise RuntimeError("Ping failed, invalid value returned from server.\nframe #0: ...")
        except RuntimeError as cause:
            raise RendezvousConnectionError("The connection to the C10d store has failed.") from cause
    except RendezvousConnectionError as error:
        return error


@pytest.mark.parametrize(
    "error, line",
    [
        (
            _connection_error(),
            "error: RDZV_ENDPOINT: no rendezvous answered at node0:29500 (is the first node's run_train.sh "
            "started, and that port open to this node?): Ping failed, invalid value returned from server.",
        ),
        (
            RendezvousTimeoutError("The node 'n1' rendezvous 'job42' has timed out."),
            "error: NNODES: the rendezvous at node0:29500 did not gather the job's nodes: "
            "The node 'n1' rendezvous 'job42' has timed out.",
        ),
    ],
)
def test_a_failed_rendezvous_is_one_line_naming_the_setting(monkeypatch, capsys, error, line):
    """torchrun's agent ended in its traceback (after a C++ stack for every retry of the store)."""
    monkeypatch.setattr(launch, "torchrun", _raising(error))
    assert launch._run(ARGV) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_refusal_in_the_error_file_is_the_last_line_and_the_exit_code(monkeypatch, capsys):
    """A rank wrote its line to the error file and exited 0: torchrun ended as for a finished job."""
    monkeypatch.setenv(ERROR_FILE_ENV, "")  # main sets it; restored after the test

    def refusing_rank(argv: list[str]) -> None:
        with open(os.environ[ERROR_FILE_ENV], "w") as f:
            f.write("2 error: training.dataset: fewer than one window\n")

    monkeypatch.setattr(launch, "torchrun", refusing_rank)
    assert launch.main(ARGV) == 2
    assert capsys.readouterr().err == "error: training.dataset: fewer than one window\n"
    assert not os.path.exists(os.environ[ERROR_FILE_ENV])  # the launcher's file is gone
