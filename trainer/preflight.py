"""Checks a job's config for a given world size in one process, before torchrun starts them all.

``python -m trainer.preflight --world-size N [config options]``: exits 2 with one line on stderr
when the config is wrong (``main`` also serves run_train.sh, which lets it count the ranks).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from typing import IO, TYPE_CHECKING

from config.job_config import (
    METRICS_FILE,
    RESOLVED_CONFIG_FILE,
    VALIDATION_FILE,
    ConfigError,
    JobConfig,
    print_error,
    written_by_a_run,
)
from config.manager import batch_layout, load_config, named_as_given, typed_options, warn_no_effect_at_degrees
from trainer.corpus import DEFAULT_DATASET, TORCHTITAN_DATASETS, check_corpus, corpus_of, is_hub
from trainer.tokenizer import build_tokenizer

# torch and the modules that use it are imported inside the functions, once the options have
# parsed: their imports take seconds, which a mistyped option need not wait for.
if TYPE_CHECKING:
    from models.llama3.model import TransformerModelArgs
    from parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 2**31 - 1
"""Ranks a torch process group holds: it counts them in a C++ int."""


def check(
    config: JobConfig, world_size: int, ranks_per_node: int | None = None, typed: frozenset[str] = frozenset()
) -> None:
    """Raises a one-line ConfigError for the first class of mistake found; with
    ``ranks_per_node`` (a launch, not a dry run) also when the model's state cannot fit a rank.
    Warns of the options in ``typed`` (the command line's) that the degrees leave without effect."""
    import torch

    from models.registry import get_model_spec
    from trainer.checkpoint import check_resume, check_seed_target
    from trainer.distributed import parallel_dims_from_config
    from trainer.hf_checkpoint import job_model_args
    from trainer.metrics import check_wandb
    from trainer.optim import build_optimizer_and_schedule

    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(
            f"world size {world_size:,} (NNODES x NGPU) is more than the {MAX_WORLD_SIZE:,} ranks a torch "
            "process group holds"
        )
    dims = parallel_dims_from_config(config.parallelism, world_size)
    batch_layout(config.training, dims.dp_degree)
    warn_no_effect_at_degrees(config, typed, dims.dp_replicate, dims.dp_shard)
    if planner := sorted(key for key in typed if key.startswith("plan.")):  # config.manager serves the planner too
        logger.warning(
            "no effect in this run: %s (the layout planner's options: python -m trainer.plan)",
            ", ".join(f"--{key}" for key in planner),
        )
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint: run it on 1 rank (NGPU=1), not {world_size}")
    if ckpt.create_seed_checkpoint:
        check_seed_target(os.path.join(config.job.dump_folder, ckpt.folder))
    if ckpt.initial_load_path and not os.path.isdir(ckpt.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path: {ckpt.initial_load_path} is not a folder")
    if ckpt.enable:
        check_resume(ckpt, os.path.join(config.job.dump_folder, ckpt.folder))
    get_model_spec(config.model.name).check_layout_fn(job_model_args(config), dims, config)
    build_optimizer_and_schedule(config, [torch.nn.Linear(1, 1)])
    check_output_folders(config)
    if config.metrics.enable_wandb and ranks_per_node is not None:  # a dry run logs nothing
        check_wandb()
    args = check_files(config, simulated=ranks_per_node is None)
    if ranks_per_node is not None:
        check_memory(config, args, dims, ranks_per_node)
        # A dry run writes nothing there: it may look at a running job's config.
        for option, folder in claimed_folders(config):
            if os.path.isfile(lock := os.path.join(folder, FOLDER_LOCK)):
                _lock(lock, option, folder).close()


CPU_RANK_FLOOR_BYTES = 300 * 2**20
"""Memory a CPU rank's process takes before any model: Python, torch and gloo (328 MiB measured
on this project's machine with torch 2.13)."""


def check_memory(config: JobConfig, args: TransformerModelArgs, dims: ParallelDims, ranks_per_node: int) -> None:
    """Refuses a job whose weights, gradients and Adam moments (16 bytes a parameter in float32, 8 in
    bfloat16, over the degrees that shard them; a seed checkpoint's weights, a quarter of that) and
    the logits of one microbatch (2 bytes a token and vocabulary entry; validation's too) alone
    exceed what a rank has, or whose CPU ranks are more processes than the host's memory holds:
    started, its ranks would run out of memory, on a CPU be killed, and be restarted to be killed
    again. The rest of the activations is not counted, so a job refused here cannot fit."""
    import torch

    from models.registry import get_model_spec
    from parallelisms.device import memory_per_rank

    available, source = memory_per_rank(ranks_per_node)
    if not torch.accelerator.is_available() and available < CPU_RANK_FLOOR_BYTES:
        raise ConfigError(
            f"NGPU {ranks_per_node}: each CPU rank's process takes about {CPU_RANK_FLOOR_BYTES / 2**30:.1f} GiB "
            f"before any model, more than the {available / 2**30:.2f} GiB a rank has ({source})"
        )
    with torch.device("meta"):
        parameters = sum(p.numel() for p in get_model_spec(config.model.name).model_cls(args).parameters())
    size = f"model: {parameters / 1e9:.2f}B parameters"
    weight_bytes = getattr(torch, config.training.dtype).itemsize
    if config.checkpoint.create_seed_checkpoint:
        if weight_bytes * parameters > available:
            raise ConfigError(
                f"{size}: a seed checkpoint holds all the weights in one process, "
                f"{weight_bytes * parameters / 2**30:.1f} GiB, "
                f"more than the {available / 2**30:.1f} GiB it has ({source})"
            )
        return
    state = 4 * weight_bytes * parameters / (dims.dp_shard * dims.tp * dims.pp)
    batch, logits = max(_forwards(config, dims).items(), key=lambda kv: kv[1])
    logits *= 2 * args.vocab_size / dims.tp
    if state + logits <= available:
        return
    if state >= logits:
        raise ConfigError(
            f"{size}: {config.training.dtype} weights, gradients and Adam moments alone take "
            f"{state / 2**30:.1f} GiB per rank "
            f"(sharded over dp_shard {dims.dp_shard} x tp {dims.tp} x pp {dims.pp}), more than the "
            f"{available / 2**30:.1f} GiB a rank has ({source}); shard over more ranks or pick a smaller model "
            "(python -m trainer.plan finds a layout that fits)"
        )
    raise ConfigError(
        f"{batch}: the logits of one forward alone take {logits / 2**30:.1f} GiB per rank, which with "
        f"{state / 2**30:.1f} GiB of weights, gradients and Adam moments is more than the "
        f"{available / 2**30:.1f} GiB a rank has ({source})"
    )


def _forwards(config: JobConfig, dims: ParallelDims) -> dict[str, int]:
    """The batches of one forward on a rank, named by their options: tokens of each."""
    t, v = config.training, config.validation
    if dims.pp > 1:
        option, sequences = (
            "parallelism.pipeline_parallel_microbatch_size",
            config.parallelism.pipeline_parallel_microbatch_size,
        )
    else:
        option, sequences = "training.local_batch_size", t.local_batch_size
    forwards = {f"{option} {sequences} x training.seq_len {t.seq_len}": sequences * t.seq_len}
    if v.enable:
        sequences, seq_len = v.local_batch_size or t.local_batch_size, v.seq_len or t.seq_len
        forwards[f"validation.local_batch_size {sequences} x validation.seq_len {seq_len}"] = sequences * seq_len
    return forwards


def out_of_memory_error(what: str, batch: str = "training.local_batch_size") -> ConfigError:
    """A run that ran out of memory (``what`` says how) on the batches of option ``batch``: the same
    batches at the same layout would run out again, so it is a mistake in the job, with what would
    fit."""
    section = batch.split(".")[0]
    return ConfigError(
        f"{batch}: {what}; a smaller local_batch_size or seq_len in [{section}], activation_checkpoint.mode "
        "selective or full, or more ranks to shard over would fit (COMM_MODE=fake ./run_train.sh estimates a "
        "rank's peak)"
    )


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    # An accelerator's allocator raises OutOfMemoryError; the CPU's a RuntimeError saying so.
    return isinstance(error, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error)


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
    from trainer.hf_checkpoint import files_no_export_wrote

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
        f = _lock(os.path.join(folder, FOLDER_LOCK), option, folder)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")  # named to the run refused
        f.flush()
        claims.append(f)
    return claims


def _lock(path: str, option: str, folder: str) -> IO[str]:
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


def check_files(config: JobConfig, simulated: bool = False) -> TransformerModelArgs:
    """Reads the start of every corpus, the tokenizer and the Hugging Face folder the run will
    use; one line names every one that is missing or broken, and every way the folder differs
    from the model. Returns the model args the run will build (the tokenizer's vocabulary; for a
    dry run, ``simulated``, the flavor's unless model.tokenizer_path is given, as the dry run
    sizes it)."""
    from trainer.hf_checkpoint import check_hf_folder, is_hf_folder, job_model_args, weights_only_problem

    options = ["training.dataset"] + (["validation.dataset"] if config.validation.enable else [])
    problems: list[str] = []
    first_documents: dict[str, str] = {}
    for option in options:
        try:
            if (document := check_corpus(corpus_of(config, option))) is not None:
                first_documents[option] = document
        except (ValueError, OSError) as e:
            problems.append(_dataset_problem(config, option, e))
        _warn_hub_options_unused(config, option)
    _warn_of_the_validation_corpus(config)
    # The default tokenizer is trained on first use, at the asked size: nothing to read yet.
    vocab_size = None if simulated else config.model.default_tokenizer_vocab_size
    if config.model.tokenizer_path:
        try:
            tokenizer = build_tokenizer(config.model.tokenizer_path, config.job.cache_dir)
            vocab_size = tokenizer.vocab_size
        except (ValueError, OSError) as e:
            problems.append(f"model.tokenizer_path: {e}")
            vocab_size = None
        else:
            # A tokenizer that cannot encode the corpus would fail in every rank of every attempt.
            for option, document in first_documents.items():
                try:
                    tokenizer.encode(document)
                except ValueError as e:
                    problems.append(f"{option}: {e}")
    args = None
    try:
        args = job_model_args(config, vocab_size)  # says when the tokenizer's vocabulary replaces the flavor's
    except ConfigError as e:
        problems.append(str(e))
    path = config.checkpoint.initial_load_path
    if path and os.path.isdir(path) and not (is_hf_folder(path) or os.path.isfile(os.path.join(path, ".metadata"))):
        problems.append(f"checkpoint.initial_load_path: {path} is neither a DCP checkpoint nor a Hugging Face folder")
    if problem := weights_only_problem(config.checkpoint):
        problems.append(problem)
    if path and is_hf_folder(path) and args is not None:
        try:
            check_hf_folder(path, args)
        except ValueError as e:
            problems.append(f"checkpoint.initial_load_path: {e}")
    if path and os.path.isfile(os.path.join(path, ".metadata")) and args is not None:
        if problem := _initial_checkpoint_problem(config, args):
            problems.append(problem)
    if problems:
        raise ConfigError("; ".join(problems))
    return args


def _initial_checkpoint_problem(config: JobConfig, args: TransformerModelArgs) -> str | None:
    """The line for a DCP checkpoint.initial_load_path whose model differs from the job's, when
    the run will load it (no checkpoint of its own to resume from, the model not excluded)."""
    import torch

    from models.registry import get_model_spec
    from trainer.checkpoint import another_model, complete_checkpoints, saved_model_difference

    ckpt = config.checkpoint
    own = os.path.join(config.job.dump_folder, ckpt.folder)
    model_excluded = "model" in ckpt.exclude_from_loading and not ckpt.initial_load_model_only
    if model_excluded or (ckpt.enable and complete_checkpoints(own)):
        return None
    with torch.device("meta"):
        model = get_model_spec(config.model.name).model_cls(args)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    difference = saved_model_difference(ckpt.initial_load_path, shapes)
    return difference and another_model("checkpoint.initial_load_path", ckpt.initial_load_path, difference)


def _warn_hub_options_unused(config: JobConfig, option: str) -> None:
    """A dataset config or split set for local files or python_docs: they are read whole; a text
    field for plain text: it has no records."""
    section_name = option.partition(".")[0]
    section = getattr(config, section_name)
    dataset = corpus_of(config, option).dataset
    unused = []
    if not is_hub(dataset):
        defaults = {"dataset_config": "", "dataset_split": type(section)().dataset_split}
        unused = [f"{section_name}.{name}" for name, default in defaults.items() if getattr(section, name) != default]
    if (dataset == DEFAULT_DATASET or dataset.endswith(".txt")) and section.dataset_text_field != "text":
        unused.append(f"{section_name}.dataset_text_field")
    if unused:
        logger.warning("no effect in this run: %s (%s is read whole, not a hub dataset)", ", ".join(unused), option)


def _warn_of_the_validation_corpus(config: JobConfig) -> None:
    """Validation on training's own corpus: the windows it scores are ones training reads (with
    the seed plus one, in the order of training's second epoch), so its loss is no held-out loss.
    Validation left on the default corpus while training reads another: its loss would be of the
    Python documentation. Nothing in the run's output says either."""
    if not config.validation.enable:
        return
    training, validation = corpus_of(config, "training.dataset"), corpus_of(config, "validation.dataset")
    # A corpus read whole is the same whatever its config and split say.
    if validation == training or (not is_hub(training.dataset) and validation.dataset == training.dataset):
        logger.warning(
            "validation.dataset reads training's corpus (%s): the windows it scores are ones training reads too "
            "(its whole second epoch in the same order); give validation.dataset a held-out corpus",
            config.validation.dataset,
        )
        return
    if config.validation.dataset == DEFAULT_DATASET and config.training.dataset != DEFAULT_DATASET:
        logger.warning(
            "validation.dataset is %s while training.dataset is %s: the validation loss is of the Python "
            "documentation; give validation.dataset the held-out part of the training corpus",
            DEFAULT_DATASET,
            config.training.dataset,
        )


def _dataset_problem(config: JobConfig, option: str, error: Exception) -> str:
    """The line for the corpus of ``option`` that ``error`` says is missing or broken."""
    name = getattr(config, option.partition(".")[0]).dataset
    hint = f" ('{name}' is torchtitan's; give local files with --{option}_path)" if name in TORCHTITAN_DATASETS else ""
    return f"{option}: {error}{hint}"


USAGE = "usage: python -m trainer.preflight (--world-size N | --nnodes N --nproc-per-node K|auto) [config options]"


def log_warnings_once() -> None:
    """Warnings on stderr as 'warning: ...', each once: the checks build the model's sizes more
    than once, and a warning about them would repeat."""
    shown: set[str] = set()

    def first_time(record: logging.LogRecord) -> bool:
        new = record.getMessage() not in shown
        shown.add(record.getMessage())
        return new

    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter("warning: %(message)s"))
    stderr.addFilter(first_time)
    logging.basicConfig(level=logging.WARNING, handlers=[stderr])


LAUNCH_OPTIONS = ("--world-size", "--nnodes", "--nproc-per-node")


def split_launch_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the launch options given first, as ``--name value`` or ``--name=value``: their values; the
    config options after them). A launch option without a value has the value ''."""
    launch: dict[str, str] = {}
    while argv and argv[0].partition("=")[0] in LAUNCH_OPTIONS:
        name, equals, value = argv[0].partition("=")
        if not equals:
            value = argv[1] if len(argv) > 1 else ""
        launch[name] = value
        argv = argv[1 if equals else 2 :]
    return launch, argv


def launch_sizes(launch: dict[str, str]) -> tuple[int, int, int] | None:
    """(world size, ranks per node, accelerators here) of the launch options: ``--world-size``, or
    ``--nnodes`` x ``--nproc-per-node`` (``auto``: one per accelerator, else 2 CPU processes);
    None when they give no world, or give it twice."""
    from parallelisms.device import accelerator_count

    accelerators = accelerator_count()
    nproc = launch.get("--nproc-per-node", "auto")
    nproc = str(accelerators or 2) if nproc == "auto" else nproc
    numbers = [nproc, launch.get("--nnodes", "1"), launch.get("--world-size", "1")]
    if ("--world-size" in launch) == ("--nnodes" in launch) or not all(n.isdecimal() for n in numbers):
        return None
    world_size = int(launch.get("--world-size") or int(launch["--nnodes"]) * int(nproc))
    return (world_size, int(nproc), accelerators) if world_size > 0 and int(nproc) > 0 else None


def main(argv: list[str]) -> int:
    """Checks the config for the world size. With ``--nnodes``, prints the ranks per node to start
    and 1 or 0 for on accelerators or not: the launcher asks torch once."""
    launch, argv = split_launch_options(argv)
    log_warnings_once()
    try:
        config = load_config(argv)  # the options first, before the imports below
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    if (sizes := launch_sizes(launch)) is None:
        print(USAGE, file=sys.stderr)
        return 2
    world_size, nproc, accelerators = sizes
    try:
        check(config, world_size, nproc, frozenset(typed_options(argv)))
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    if "--nnodes" in launch:
        print(nproc, int(accelerators > 0))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the check ends, without a traceback
    sys.exit(main(sys.argv[1:]))
