"""The run's output folders: checked writable before anything runs, claimed for one run at a time,
and the run's own files written whole."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import socket
import tempfile
from typing import IO

from config.errors import ConfigError
from config.job_config import METRICS_FILE, RESOLVED_CONFIG_FILE, VALIDATION_FILE, JobConfig, written_by_a_run


def check_output_folders(config: JobConfig) -> None:
    """Raises a one-line ConfigError naming the option when a folder the run will write to cannot
    be made or written. Found by the run itself, a checkpoint folder fails at the first save (after
    the steps before it, and again on every restart), a trace folder crashes the profiler."""
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
    """A one-line ConfigError when a file the run writes in the dump folder is an input or a file
    no run wrote, or two of them are one file: the resolved config would replace the config file
    it was read from or a file of the user's, and job.save_config_file would replace the resolved
    config, put JSON into the metrics, or land outside the dump folder."""
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
    if config.checkpoint.export_hf:
        _check_export_folder(os.path.join(dump, config.checkpoint.folder, "hf"))
    if config.job.save_config_file:
        _check_save_config_file(config.job.save_config_file, dump, folders)
    _check_no_folder_is_a_run_file(config, folders)


def _check_export_folder(folder: str) -> None:
    """A one-line ConfigError when the folder checkpoint.export_hf replaces holds files no export
    wrote: they would be deleted with the earlier export at the end of the run."""
    from trainer.checkpoint.hf import files_no_export_wrote

    if foreign := files_no_export_wrote(folder):
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"checkpoint.export_hf: {folder} holds files no export wrote ({shown}), which the export would "
            "delete with the folder it replaces; move them or give another checkpoint.folder or job.dump_folder"
        )


def _check_no_folder_is_a_run_file(config: JobConfig, folders: list[tuple[str, str]]) -> None:
    """A one-line ConfigError when a folder option names a file the run writes in the dump folder,
    or a folder inside one: one of the two writes would fail in the ranks (a checkpoint folder at
    the first save, after the steps before it), and the restart would fail again."""
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


def write_run_file(path: str, text: str) -> None:
    """Writes a file of the run's (its resolved config) whole or not at all: the other ranks check
    it (``check_output_folders``) while rank 0 writes it, and must see the earlier file or this one,
    never a part."""
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _config_json(path: str) -> bool:
    """Whether the file at ``path`` is a job.save_config_file a run wrote: a JSON object of the
    config's sections."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and set(saved) == {field.name for field in dataclasses.fields(JobConfig)}


FOLDER_LOCK = ".tessera.lock"


def claimed_folders(config: JobConfig) -> list[tuple[str, str]]:
    """(option, folder) of the folders a run holds: the dump folder, and a checkpoint folder
    outside it."""
    dump = config.job.dump_folder
    folders = [("job.dump_folder", dump)]
    if config.checkpoint.enable:
        checkpoints = os.path.realpath(os.path.join(dump, config.checkpoint.folder))
        if os.path.commonpath([checkpoints, os.path.realpath(dump)]) != os.path.realpath(dump):
            folders.append(("checkpoint.folder", checkpoints))
    return folders


def claim_folders(config: JobConfig) -> list[IO[str]]:
    """Marks the run's folders (``claimed_folders``) as this process's for as long as the returned
    files stay open or the process lives; a one-line ConfigError when another process holds one.
    Two runs in one folder would interleave their metrics, and each resume from and delete the
    other's checkpoints. The kernel drops a dead process's lock, so a crashed or killed run leaves
    no stale claim."""
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
    """The lock file at ``path``, locked; a one-line ConfigError naming ``option`` and the lock's
    holder when another process holds it."""
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
    longest = os.pathconf(existing, "PC_NAME_MAX")
    for name in os.path.relpath(os.path.abspath(folder), existing).split(os.sep):
        if len(os.fsencode(name)) > longest:
            return f"cannot create {folder}: a name of {len(os.fsencode(name))} bytes, where {existing} takes {longest}"
    try:
        # A few bytes written, not only a name made: a full disk still takes new names.
        with tempfile.TemporaryFile(prefix=".tessera-write-check-", dir=existing) as probe:
            probe.write(bytes(_PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        where = "" if existing == os.path.abspath(folder) else f"cannot create {folder}: "
        return f"{where}nothing can be written in {existing} ({e.strerror})"
    return None


_PROBE_BYTES = 64 * 1024
