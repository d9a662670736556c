"""run_train.sh's torchrun: ``python -m programs.launch [torchrun options] train.py [options]``, with
one line and an exit code for each way a job ends: a rank's refusal (trainer/refusal.py), a signal
(128 + its number), ranks that failed every attempt (torchrun's table, 1), a failed rendezvous (2)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile


def _stopped_while_starting(signum: int, frame: object) -> None:
    print(f"stopped by {signal.Signals(signum).name} before the ranks started", file=sys.stderr)
    os._exit(128 + signum)


if __name__ == "__main__":
    # Ctrl-C while torch is imported, before torchrun takes the signal: one line, not a traceback.
    signal.signal(signal.SIGINT, _stopped_while_starting)
    # The agent's store client logs each retry of an unanswered rendezvous with a C++ stack. Read
    # once, when torch loads: the ranks keep the user's level.
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        import torch  # noqa: F401

        del os.environ["TORCH_CPP_LOG_LEVEL"]

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.run import main as torchrun

from config.errors import first_line, print_error
from trainer.refusal import ERROR_FILE_ENV


def main(argv: list[str]) -> int:
    descriptor, error_file = tempfile.mkstemp(prefix="tessera-error-")
    os.close(descriptor)
    os.environ[ERROR_FILE_ENV] = error_file  # the ranks inherit it
    try:
        code = _run(argv)
        with open(error_file) as f:
            refusal = f.read().strip()
    finally:
        os.unlink(error_file)
    if not refusal:
        return code
    refusal_code, line = refusal.split(" ", 1)
    print(line, file=sys.stderr)
    return int(refusal_code)


def _run(argv: list[str]) -> int:
    try:
        torchrun(argv)
    except SignalException as e:
        print(
            f"stopped by {e.sigval.name}: every rank ended (with checkpoint.enable the same command "
            "resumes from the newest complete checkpoint)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    except RendezvousError as e:
        # --rdzv-endpoint as run_train.sh passes it; --standalone serves one on localhost.
        endpoint = next((a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-endpoint=")), "localhost")
        cause = first_line(e.__cause__ or e)
        if isinstance(e, RendezvousConnectionError):
            print_error(
                f"RDZV_ENDPOINT: no rendezvous answered at {endpoint} (is the first node's run_train.sh "
                f"started, and that port open to this node?): {cause}"
            )
        else:
            print_error(f"NNODES: the rendezvous at {endpoint} did not gather the job's nodes: {cause}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
