"""run_train.sh's torchrun: ``python -m trainer.launch [torchrun options] train.py [options]``.

torchrun's agent ends in a traceback of its own when it is stopped by a signal (Ctrl-C, a
scheduler's SIGTERM) and when the ranks failed on every attempt. Here a signal ends in one line and
the shell's exit code for it (130 for SIGINT), and failed ranks in torchrun's table of failures
alone, with exit code 1.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main(argv: list[str]) -> int:
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
