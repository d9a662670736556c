"""train.py's sorting of a failed run's errors: a peer's death or hang is one line and a restart,
anything else a traceback."""

import pytest

from train import _is_collective_failure


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
