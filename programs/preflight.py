"""``python -m programs.preflight --world-size N [config options]``: checks a job's config in one
process before torchrun starts the ranks; exits 2 with one line on stderr when it is wrong."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from config.errors import ConfigError, print_error
from config.evaluation import read_tasks
from config.job_config import JobConfig, Training, Validation
from config.manager import load_config, named_as_given, typed_options
from config.rules import batch_layout, warn_no_effect_at_degrees
from trainer.data.corpus import (
    DEFAULT_DATASET,
    TORCHTITAN_DATASETS,
    Corpus,
    RecordBatch,
    check_corpus,
    corpus_of,
    is_hub,
)
from trainer.data.shards import INDEX_FILE, DocumentEncoder, ShardedTokens, encoder_for, token_folder
from trainer.data.tokenizer import build_tokenizer
from trainer.folders import FOLDER_LOCK, check_output_folders, claimed_folders, lock_folder

# torch and the modules that use it are imported inside the functions, once the options have
# parsed: their imports take seconds, which a mistyped option need not wait for.
if TYPE_CHECKING:
    from models.llama3.model import TransformerModelArgs
    from parallelisms.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

MAX_WORLD_SIZE = 2**31 - 1  # a torch process group counts its ranks in a C++ int


def check(
    config: JobConfig,
    world_size: int,
    ranks_per_node: int | None = None,
    typed: frozenset[str] = frozenset(),
    elastic: bool = False,
) -> None:
    """Raises a one-line ConfigError for the first mistake found; with ``ranks_per_node`` (a launch,
    not a dry run) also when the model cannot fit a rank. Warns of ``typed`` options without effect.
    ``elastic``: a node of a node range, which may join the running job that holds the folders."""
    import torch

    from models.registry import get_model_spec
    from models.sizes import job_model_args
    from trainer.checkpoint.rules import check_export_folder, check_resume, check_seed_checkpoint
    from trainer.distributed import parallel_dims_from_config
    from trainer.fault_tolerance import check_fault_tolerance_environment
    from trainer.metrics import check_wandb
    from trainer.optim import build_optimizer_and_schedule

    if ranks_per_node is not None:  # a dry run starts no replica group
        check_fault_tolerance_environment(config.fault_tolerance)
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(
            f"world size {world_size:,} (NNODES x NGPU) is more than the {MAX_WORLD_SIZE:,} ranks a torch "
            "process group holds"
        )
    dims = parallel_dims_from_config(config.parallelism, world_size)
    batch_layout(config.training, dims.dp_degree)
    # Parameters shard over the context-parallel ranks too.
    warn_no_effect_at_degrees(config, typed, dims.dp_replicate, dims.dp_shard * dims.cp)
    if planner := sorted(key for key in typed if key.startswith("plan.")):  # config.manager serves the planner too
        logger.warning(
            "no effect in this run: %s (the layout planner's options: python -m programs.plan)",
            ", ".join(f"--{key}" for key in planner),
        )
    ckpt = config.checkpoint
    if ckpt.create_seed_checkpoint:
        check_seed_checkpoint(os.path.join(config.job.dump_folder, ckpt.folder), world_size)
    if ckpt.enable:
        check_resume(ckpt, os.path.join(config.job.dump_folder, ckpt.folder))
    if ckpt.export_hf:
        check_export_folder(os.path.join(config.job.dump_folder, ckpt.folder, "hf"))
    get_model_spec(config.model.name).check_layout_fn(job_model_args(config), dims, config)
    build_optimizer_and_schedule(config.optimizer, config.lr_scheduler, config.training, [torch.nn.Linear(1, 1)])
    check_output_folders(config)
    if config.metrics.enable_wandb and ranks_per_node is not None:  # a dry run logs nothing
        check_wandb()
    if config.eval.freq:
        read_tasks(
            config.eval, config.training.seq_len
        )  # a broken record would stop every rank at its first evaluation
    args = check_files(config, simulated=ranks_per_node is None)
    if ranks_per_node is not None:
        check_memory(config, args, dims, ranks_per_node)
        # A dry run writes nothing there: it may look at a running job's config.
        for option, folder in [] if elastic else claimed_folders(config):
            if os.path.isfile(lock := os.path.join(folder, FOLDER_LOCK)):
                lock_folder(lock, option, folder).close()


CPU_RANK_FLOOR_BYTES = 300 * 2**20  # Python, torch and gloo in a CPU rank (328 MiB measured with torch 2.13)


def check_memory(config: JobConfig, args: TransformerModelArgs, dims: ParallelDims, ranks_per_node: int) -> None:
    """Refuses a job whose weights, gradients, Adam moments and one forward's logits alone exceed a
    rank's memory (its ranks would be killed, restarted, killed again); other activations not counted."""
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
    if config.training.enable_cpu_offload and torch.accelerator.is_available():
        state = 0  # in host memory (on CPU ranks host and device memory are one)
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
            "(python -m programs.plan finds a layout that fits)"
        )
    raise ConfigError(
        f"{batch}: the logits of one forward alone take {logits / 2**30:.1f} GiB per rank, which with "
        f"{state / 2**30:.1f} GiB of weights, gradients and Adam moments is more than the "
        f"{available / 2**30:.1f} GiB a rank has ({source})"
    )


def _forwards(config: JobConfig, dims: ParallelDims) -> dict[str, int]:
    """The batches of one forward on a rank, named by their options: tokens of each."""
    t, v = config.training, config.validation
    option = "parallelism.pipeline_parallel_microbatch_size" if dims.pp > 1 else "training.local_batch_size"
    sequences = config.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else t.local_batch_size
    forwards = {f"{option} {sequences} x training.seq_len {t.seq_len}": sequences * t.seq_len}
    if v.enable:
        sequences, seq_len = v.local_batch_size or t.local_batch_size, v.seq_len or t.seq_len
        forwards[f"validation.local_batch_size {sequences} x validation.seq_len {seq_len}"] = sequences * seq_len
    return forwards


def check_files(config: JobConfig, simulated: bool = False) -> TransformerModelArgs:
    """Reads the start of every corpus, the tokenizer and the HF folder the run will use; one line
    names every one that is broken. Returns the model args the run (or a dry run, ``simulated``) builds."""
    from models.sizes import is_hf_folder, job_model_args
    from trainer.checkpoint.hf import check_hf_folder
    from trainer.checkpoint.rules import initial_load_problem

    problems: list[str] = []
    first_records = _check_corpora(config, problems)
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
            # A record the tokenizer (or the chat template) cannot encode would fail every rank of every attempt.
            for option, section, corpus, first in first_records:
                try:
                    encoder = encoder_for(section, config.training, tokenizer)
                    encoder.encode_batch(first.values, first.where)
                    _check_prepared_shards(corpus, encoder, config.job.cache_dir)
                except ValueError as e:
                    problems.append(f"{option}: {e}")
    args = None
    try:
        args = job_model_args(config, vocab_size)  # says when the tokenizer's vocabulary replaces the flavor's
    except ConfigError as e:
        problems.append(str(e))
    path = config.checkpoint.initial_load_path
    if problem := initial_load_problem(config.checkpoint):
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
    """The line for a DCP checkpoint.initial_load_path of another model than the job's, if loaded."""
    import torch

    from models.registry import get_model_spec
    from trainer.checkpoint.integrity import complete_checkpoints
    from trainer.checkpoint.rules import another_model, saved_model_difference

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
    """Warns of dataset options a corpus read whole (local files, python_docs, plain text) ignores."""
    section_name = option.partition(".")[0]
    section = getattr(config, section_name)
    dataset = corpus_of(section).dataset
    unused = []
    if not is_hub(dataset):
        defaults = {"dataset_config": "", "dataset_split": type(section)().dataset_split}
        unused = [f"{section_name}.{name}" for name, default in defaults.items() if getattr(section, name) != default]
    if (dataset == DEFAULT_DATASET or dataset.endswith(".txt")) and section.dataset_text_field != "text":
        unused.append(f"{section_name}.dataset_text_field")
    if unused:
        logger.warning("no effect in this run: %s (%s is read whole, not a hub dataset)", ", ".join(unused), option)


def _warn_of_the_validation_corpus(config: JobConfig) -> None:
    """Validation on training's own corpus, or left on the default one while training reads another:
    its loss is no held-out loss, and nothing in the run's output says so."""
    if not config.validation.enable:
        return
    training, validation = corpus_of(config.training), corpus_of(config.validation)
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


def _check_prepared_shards(corpus: Corpus, encoder: DocumentEncoder, cache_dir: str) -> None:
    """Raises the line for a local corpus whose finished shard folder lost or cut a file since: every rank
    would stop on it. A hub corpus's folder is named by its commit, which only the ranks ask for."""
    if is_hub(corpus.dataset):
        return
    folder = token_folder(corpus, encoder, cache_dir)
    if os.path.exists(os.path.join(folder, INDEX_FILE)):
        ShardedTokens(folder)


def _check_corpora(
    config: JobConfig, problems: list[str]
) -> list[tuple[str, Training | Validation, Corpus, RecordBatch]]:
    """Reads the first record of every corpus of the run; each one broken adds its line to ``problems``.
    Returns the first records with their options, sections and corpora."""
    from trainer.data.loader import section_corpora

    chat = config.training.dataset_format == "chat"
    sections = [config.training] + ([config.validation] if config.validation.enable else [])
    first_records = []
    for section in sections:
        name = "training" if section is config.training else "validation"
        corpora, _ = section_corpora(section)
        option = f"{name}.datasets" if len(corpora) > 1 else f"{name}.dataset"
        field = "messages" if chat else section.dataset_text_field
        for corpus in corpora:
            try:
                if (first := check_corpus(corpus, field, text=not chat)) is not None:
                    first_records.append((option, section, corpus, first))
            except (ValueError, OSError) as e:
                problems.append(_dataset_problem(config, option, e))
        _warn_hub_options_unused(config, f"{name}.dataset")
    return first_records


def _dataset_problem(config: JobConfig, option: str, error: Exception) -> str:
    """The line for the corpus of ``option`` that ``error`` says is missing or broken."""
    name = getattr(config, option.partition(".")[0]).dataset
    hint = f" ('{name}' is torchtitan's; give local files with --{option}_path)" if name in TORCHTITAN_DATASETS else ""
    return f"{option}: {error}{hint}"


USAGE = (
    "usage: python -m programs.preflight (--world-size N | --nnodes N|MIN:MAX --nproc-per-node K|auto) [config options]"
)


def log_warnings_once() -> None:
    """Warnings on stderr as 'warning: ...', each once (the checks size the model more than once)."""
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
    """(the values of the launch options given first, '' when missing; the config options after)."""
    launch: dict[str, str] = {}
    while argv and argv[0].partition("=")[0] in LAUNCH_OPTIONS:
        name, equals, value = argv[0].partition("=")
        if not equals:
            value = argv[1] if len(argv) > 1 else ""
        launch[name] = value
        argv = argv[1 if equals else 2 :]
    return launch, argv


def check_elastic(config: JobConfig, nodes: range, ranks_per_node: int) -> None:
    """An elastic job (NNODES=MIN:MAX, checked at MAX as any job) also runs at each smaller node count:
    its model split divides the world there, and the global batch it starts with at MAX is kept."""
    from trainer.distributed import elastic_parallelism, parallel_dims_from_config

    full = parallel_dims_from_config(config.parallelism, nodes[-1] * ranks_per_node)
    global_batch, _ = batch_layout(config.training, full.dp_degree)
    within = f"of {nodes[0]}:{nodes[-1]}"
    for count in nodes[:-1]:
        try:
            parallelism = elastic_parallelism(config.parallelism, count * ranks_per_node)
        except ConfigError as e:
            raise ConfigError(f"{e} (at NNODES={count} {within})") from None
        per_microbatch = (
            config.training.local_batch_size * parallel_dims_from_config(parallelism, count * ranks_per_node).dp_degree
        )
        if global_batch % per_microbatch:
            raise ConfigError(
                f"training.global_batch_size: {global_batch} sequences per step (at NNODES={nodes[-1]}) cannot be "
                f"kept at NNODES={count} {within}: training.local_batch_size x data-parallel degree there is "
                f"{per_microbatch}; set training.global_batch_size to a multiple of it"
            )


def node_range(launch: dict[str, str]) -> range | None:
    """The node counts of an elastic ``--nnodes MIN:MAX`` (1 <= MIN <= MAX), which then gives MAX alone
    in ``launch``; None for any other ``--nnodes``."""
    low, colon, high = launch.get("--nnodes", "").partition(":")
    if not (colon and low.isdecimal() and high.isdecimal() and 1 <= int(low) <= int(high)):
        return None
    launch["--nnodes"] = high
    return range(int(low), int(high) + 1)


def launch_sizes(launch: dict[str, str]) -> tuple[int, int, int] | None:
    """(world size, ranks per node, accelerators here) of ``--world-size`` or ``--nnodes`` x
    ``--nproc-per-node`` (``auto``: one per accelerator, else 2); None unless given once."""
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
    """Checks the config; with ``--nnodes`` prints the ranks per node, 1/0 for accelerators or not, and 1/0
    for memory_estimation.enable."""
    launch, argv = split_launch_options(argv)
    log_warnings_once()
    try:
        config = load_config(argv)  # the options first, before the imports below
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    nodes = node_range(launch)
    if (sizes := launch_sizes(launch)) is None:
        print(USAGE, file=sys.stderr)
        return 2
    world_size, nproc, accelerators = sizes
    try:
        check(config, world_size, nproc, frozenset(typed_options(argv)), elastic=nodes is not None)
        if nodes is not None:
            check_elastic(config, nodes, nproc)
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    if "--nnodes" in launch:  # for run_train.sh: the ranks per node, on accelerators or not, a dry run first or not
        print(nproc, int(accelerators > 0), int(config.memory_estimation.enable))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the check ends, without a traceback
    sys.exit(main(sys.argv[1:]))
