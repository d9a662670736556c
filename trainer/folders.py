"""The run's output folders: checked writable before anything runs, claimed for one run at a time,
and the run's own files written whole."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from config.errors import ConfigError
from config.job_config import METRICS_FILE, RESOLVED_CONFIG_FILE, VALIDATION_FILE, JobConfig, written_by_a_run


def check_output_folders(config: JobConfig) -> None:
    """A one-line ConfigError naming the option of a folder the run cannot make or write: found by
    the run, it would fail late (a checkpoint folder at the first save, on every restart)."""
    dump = config.job.dump_folder
    folders = [("job.dump_folder", dump), ("job.cache_dir", config.job.cache_dir)]
    ckpt = config.checkpoint
    if ckpt.enable or ckpt.create_seed_checkpoint:
        folders.append(("checkpoint.folder", os.path.join(dump, ckpt.folder)))
    if config.metrics.enable_tensorboard:
        folders.append(("metrics.save_tb_folder", os.path.join(dump, config.metrics.save_tb_folder)))
        if config.job.run_name:
            folders.append(("job.run_name", os.path.join(dump, config.metrics.save_tb_folder, config.job.run_name)))
    if config.profiling.enable_profiling:
        folders.append(("profiling.save_traces_folder", os.path.join(dump, config.profiling.save_traces_folder)))
    if config.profiling.enable_memory_snapshot:
        snapshots = os.path.join(dump, config.profiling.save_memory_snapshot_folder)
        folders.append(("profiling.save_memory_snapshot_folder", snapshots))
    if config.comm.trace_buf_size > 0:
        folders.append(("comm.save_traces_folder", os.path.join(dump, config.comm.save_traces_folder)))
    if config.job.save_config_file:
        folders.append(("job.save_config_file", os.path.dirname(os.path.join(dump, config.job.save_config_file))))
    for option, folder in folders:
        if problem := _unwritable(folder):
            raise ConfigError(f"{option}: {problem}")
    _check_written_files(config, folders)


def _check_written_files(config: JobConfig, folders: list[tuple[str, str]]) -> None:
    """A one-line ConfigError when a file the run writes in the dump folder would replace an input,
    a file no run wrote, or another of the run's files, or would land outside the dump folder."""
    dump = config.job.dump_folder
    resolved = os.path.realpath(os.path.join(dump, RESOLVED_CONFIG_FILE))
    if os.path.isfile(resolved) and not written_by_a_run(resolved):
        if config.job.config_file and os.path.realpath(config.job.config_file) == resolved:
            raise ConfigError(
                f"job.config_file: {config.job.config_file} is the {RESOLVED_CONFIG_FILE} this run writes into "
                "job.dump_folder, and would be overwritten; copy it elsewhere or pick another job.dump_folder"
            )
        raise ConfigError(
            f"job.dump_folder: {os.path.join(dump, RESOLVED_CONFIG_FILE)} was not written by a run, and this run "
            "would overwrite it with its options; move it or pick another job.dump_folder"
        )
    if config.job.save_config_file:
        _check_save_config_file(config.job.save_config_file, dump, folders)
    _check_no_folder_is_a_run_file(config, folders)


def _check_no_folder_is_a_run_file(config: JobConfig, folders: list[tuple[str, str]]) -> None:
    """A one-line ConfigError when a folder option names a file the run writes, or a folder in one."""
    dump, job = config.job.dump_folder, config.job
    files = [RESOLVED_CONFIG_FILE, METRICS_FILE] + [VALIDATION_FILE] * config.validation.enable
    files += [job.save_config_file] if job.save_config_file else []
    for option, folder in folders:
        if option in ("job.dump_folder", "job.save_config_file"):
            continue
        made = os.path.realpath(folder)
        for name in files:
            written = os.path.realpath(os.path.join(dump, name))
            if os.path.commonpath([made, written]) == written:
                raise ConfigError(f"{option}: {folder} would make a folder of {name}, a file the run writes")


def _check_save_config_file(name: str, dump: str, folders: list[tuple[str, str]]) -> None:
    if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir:
        raise ConfigError(f"job.save_config_file: {name} is not a file inside job.dump_folder {dump}")
    saved = os.path.realpath(os.path.join(dump, name))
    for written in (RESOLVED_CONFIG_FILE, METRICS_FILE, VALIDATION_FILE, FOLDER_LOCK):
        if saved == os.path.realpath(os.path.join(dump, written)):
            raise ConfigError(f"job.save_config_file: {name} is the {written} the run writes")
    for option, folder in folders:
        if saved == os.path.realpath(folder):
            raise ConfigError(f"job.save_config_file: {name} is the folder of {option}")
    if os.path.isfile(saved) and not _config_json(saved):
        raise ConfigError(
            f"job.save_config_file: {os.path.join(dump, name)} exists and is not a config a run wrote; "
            "the run would overwrite it"
        )


def write_whole(path: str, write: Callable[[str], None], sync: bool = False) -> None:
    """Makes ``path`` whole or not at all: ``write(partial)`` writes a file beside it that replaces it.
    ``sync``: on disk first, for a file that vouches for others (a checkpoint's marker)."""
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        write(partial)
        if sync:
            with open(partial, "rb") as f:
                os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


def write_run_file(path: str, text: str, sync: bool = False) -> None:
    write_whole(path, lambda partial: Path(partial).write_text(text), sync)


def free_path(stem: str, extension: str = "") -> str:
    """The first of ``stem + extension``, ``stem-1 + extension``, ... that does not exist."""
    free, n = stem + extension, 1
    while os.path.lexists(free):
        free, n = f"{stem}-{n}{extension}", n + 1
    return free


def _config_json(path: str) -> bool:
    """Whether ``path`` is a job.save_config_file a run wrote: a JSON object of the config's sections."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and set(saved) == {field.name for field in dataclasses.fields(JobConfig)}


FOLDER_LOCK = ".tessera.lock"


def claimed_folders(config: JobConfig) -> list[tuple[str, str]]:
    """(option, folder) of the dump folder, and of a checkpoint folder outside it."""
    dump = config.job.dump_folder
    folders = [("job.dump_folder", dump)]
    if config.checkpoint.enable:
        checkpoints = os.path.realpath(os.path.join(dump, config.checkpoint.folder))
        if os.path.commonpath([checkpoints, os.path.realpath(dump)]) != os.path.realpath(dump):
            folders.append(("checkpoint.folder", checkpoints))
    return folders


def check_folders_at_start(config: JobConfig) -> None:
    """``check_output_folders`` on a first attempt in rank 0 unless preflight did it (its launcher sets
    the error file); on a restart in every rank, so that none waits for a refusing rank 0 to join."""
    from trainer.distributed import is_first_attempt
    from trainer.refusal import ERROR_FILE_ENV

    if not is_first_attempt() or (os.environ.get("RANK", "0") == "0" and not os.environ.get(ERROR_FILE_ENV)):
        check_output_folders(config)


def claim_folders(config: JobConfig) -> list[IO[str]]:
    """Locks the run's folders while the returned files stay open: two runs in one folder would mix
    their metrics and delete each other's checkpoints. The kernel drops a dead process's lock."""
    claims = []
    for option, folder in claimed_folders(config):
        os.makedirs(folder, exist_ok=True)
        f = lock_folder(os.path.join(folder, FOLDER_LOCK), option, folder)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")  # named to the run refused
        f.flush()
        claims.append(f)
    return claims


def lock_folder(path: str, option: str, folder: str) -> IO[str]:
    """The lock file at ``path``, locked; a one-line ConfigError naming its holder if another has it."""
    f = open(path, "a+")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(
            f"{option}: {folder} is in use by another run ({holder}); stop it, or give this run another folder"
        ) from None
    return f


def _unwritable(folder: str) -> str | None:
    """Why ``folder`` cannot be created or written, else None; leaves nothing behind."""
    if not folder:
        return "no folder given ('.' is the working folder)"
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        if existing == os.path.abspath(folder):
            return f"{folder} is not a folder"
        return f"cannot create {folder}: {existing} is not a folder"
    try:
        # A few bytes written, not only a name made: a full disk still takes new names.
        with tempfile.TemporaryFile(prefix=".tessera-write-check-", dir=existing) as probe:
            probe.write(bytes(64 * 1024))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        where = "" if existing == os.path.abspath(folder) else f"cannot create {folder}: "
        return f"{where}nothing can be written in {existing} ({e.strerror})"
    return None
