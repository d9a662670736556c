"""A mistake no restart can mend, found inside the ranks: one line, exit code 2, no restart.

Under run_train.sh's launcher (programs/launch.py) the rank writes "2 error: line" to the file named
by ERROR_FILE_ENV and exits 0, as torchrun neither restarts nor fails a group whose ranks all end 0;
the line also goes to torchrun's store, where other nodes' ranks find it when their collectives
break. torch is imported only then: a config error stays quick."""

from __future__ import annotations

import datetime
import os

from config.errors import ConfigError, print_error

ERROR_FILE_ENV = "TESSERA_ERROR_FILE"


def refuse(error: ConfigError) -> int:
    """Ends this rank for ``error``; its exit code."""
    if not os.environ.get(ERROR_FILE_ENV):
        print_error(error)
        return 2
    line = f"2 error: {error}\n"
    _write_error_file(line)
    _torchrun_store().set(_refusal_key(), line)
    return 0


def job_refused() -> bool:
    """Whether a rank of this job, on this node or another, met such a mistake (its line is then in
    this node's error file, for the launcher to print)."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        return False
    if os.path.getsize(error_file) == 0 and (store := _torchrun_store()).check([_refusal_key()]):
        _write_error_file(store.get(_refusal_key()).decode())
    return os.path.getsize(error_file) > 0


def _write_error_file(line: str) -> None:
    with open(os.environ[ERROR_FILE_ENV], "w") as f:
        f.write(line)


def _refusal_key() -> str:
    # Under the run's id: jobs on one rendezvous port share a store.
    return f"tessera/refusal/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def _torchrun_store():
    from trainer.distributed import torchrun_store

    return torchrun_store(datetime.timedelta(seconds=30))
