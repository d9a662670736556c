"""programs/launch.py (run_train.sh's torchrun): a failed rendezvous is one line, exit 2; so is a
rendezvous port taken by a program that is not a rendezvous store."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

from programs import launch

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
    assert launch._run(ARGV) == (2, "")
    assert capsys.readouterr().err.splitlines() == [line]


def _holder_line(monkeypatch, port: int) -> str | None:
    """_foreign_rendezvous_holder for a job whose rendezvous is on ``port`` of this host, whose
    listener's program this user cannot see (as another user's)."""
    monkeypatch.setattr(launch, "_listeners", lambda _: (True, []))
    monkeypatch.setattr(launch, "STORE_PROBE_SECONDS", 2)
    return launch._foreign_rendezvous_holder([f"--rdzv-endpoint=localhost:{port}"])


def test_a_listener_that_cannot_be_seen_and_does_not_answer_as_a_store_is_one_line(monkeypatch):
    """It was joined, and the agent waited on it without a word (in this sandbox, a proxy listening
    on port 2024 held a run for as long as it was let wait)."""
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        line = _holder_line(monkeypatch, port)
    # Closed, the listener ends the probe's client, which logs that with C++ stacks: within the
    # test, whose output is kept, rather than in another test's or none's.
    deadline = time.monotonic() + 30
    while any(t.name == "rendezvous-store-probe" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert line == (
        f"RDZV_ENDPOINT: port {port} of this host, where the job's rendezvous is to be, is taken by a program "
        "this user cannot see, which does not answer as a rendezvous store within 2 s; choose a free port"
    )


def test_a_listener_that_cannot_be_seen_and_answers_as_a_store_is_joined(monkeypatch):
    """Another node's agent in a container of this host (another PID namespace) serves the store."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _holder_line(monkeypatch, store.port) is None
