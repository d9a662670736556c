"""A mistake no restart can mend, found inside the ranks: one line, exit code 2. Under programs/launch.py
the rank writes "2 error: line" to ERROR_FILE_ENV's file (and torchrun's store, for other nodes) and
exits 0, which torchrun does not restart."""

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
    """Whether a rank of this job on any node met such a mistake (its line is then in the error file)."""
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
