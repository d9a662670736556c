"""run_train.sh's torchrun: ``python -m trainer.launch [torchrun options] train.py [options]``.

What it adds to torchrun:
- A rank that meets a mistake no restart can mend writes "CODE line" to the file named by
  ``TESSERA_ERROR_FILE`` (made here) and exits 0, so that torchrun does not start the group again;
  the line is printed last and the code returned.
- Stopped by a signal (Ctrl-C, a scheduler's SIGTERM; run_train.sh execs this process, so a signal
  sent to the script's process lands here), the agent stops the ranks and raises an exception:
  here that ends in one line and the shell's exit code for the signal (130 for SIGINT).
- Ranks that failed on every attempt end in torchrun's table of failures, exit code 1, without the
  agent's traceback around it.
"""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main(argv: list[str]) -> int:
    descriptor, error_file = tempfile.mkstemp(prefix="tessera-error-")
    os.close(descriptor)
    os.environ["TESSERA_ERROR_FILE"] = error_file  # the ranks inherit it
    try:
        code = _run(argv)
        with open(error_file) as f:
            refusal = f.read().strip()
    finally:
        os.unlink(error_file)
    if refusal:
        refusal_code, line = refusal.split(" ", 1)
        print(line, file=sys.stderr)
        return int(refusal_code)
    return code


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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
