"""Typed job configuration: defaults < TOML file < command line.

Every section is a dataclass; the string under each field is its documentation, shown by
``--help``. TOML tables and CLI flags use the field names: ``[training] steps = 20`` or
``--training.steps 20``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import os
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A user error in the configuration: reported as one line, without a traceback."""


def _default_cache_dir() -> str:
    return os.environ.get("TESSERA_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tessera"
    )


@dataclass
class Job:
    config_file: str = ""
    """TOML file with the job's settings; command-line flags override it."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, metrics, TensorBoard, checkpoints."""
    description: str = ""
    """Free text describing the job, logged at start."""
    run_name: str = ""
    """TensorBoard run sub-folder under <dump_folder>/tb; empty = a timestamp."""
    cache_dir: str = field(default_factory=_default_cache_dir)
    """Where the default tokenizer and tokenized corpora are cached (env TESSERA_CACHE_DIR)."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family from the registry."""
    flavor: str = "debugmodel"
    """Size of the model within its family: debugmodel, debugmodel_wide, 8B, 70B, 405B."""
    tokenizer_path: str = ""
    """Sentencepiece .model or tiktoken BPE file; empty = a tokenizer trained on the default corpus."""
    default_tokenizer_vocab_size: int = 2048
    """Vocabulary size of the tokenizer trained on first use when tokenizer_path is empty."""


@dataclass
class Training:
    dataset: str = "python_docs"
    """'python_docs' (the interpreter's own documentation) or a .txt/.jsonl file or a folder of them."""
    seq_len: int = 256
    """Tokens per training sequence."""
    local_batch_size: int = 8
    """Sequences per rank per microbatch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1 = local x data-parallel degree.
    Larger multiples accumulate gradients over microbatches."""
    steps: int = 100
    """Optimizer steps to train."""
    max_norm: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    mixed_precision_param: str = "float32"
    """Dtype of parameters in forward/backward compute: float32 or bfloat16."""
    mixed_precision_reduce: str = "float32"
    """Dtype of gradient reduction across data-parallel ranks: float32 or bfloat16."""
    dataloader_num_workers: int = 0
    """Data-loading worker processes per rank."""
    nonfinite_policy: str = "error"
    """On a non-finite loss or gradient norm: error (stop; the restart resumes from the last
    checkpoint), skip_step (drop the update and the batch) or rollback (reload the last checkpoint
    and go on past the batches since)."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer class: AdamW or Adam."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: str = "foreach"
    """Kernel choice: foreach, fused (where the device supports it) or for-loop."""


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Steps of linear warmup to the peak learning rate."""
    decay_type: str = "linear"
    """Shape of the decay after warmup: linear, cosine or sqrt."""
    decay_ratio: typing.Optional[float] = None
    """Fraction of all steps spent decaying at the end (WSD); unset = decay over all steps after warmup."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Ranks holding full replicas (DDP, or the replicate dimension of HSDP)."""
    data_parallel_shard_degree: int = -1
    """Ranks sharding the parameters (FSDP, or the shard dimension of HSDP); -1 = the rest."""
    tensor_parallel_degree: int = 1
    """Ranks splitting each layer's matmuls (tensor parallelism)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages."""
    data_parallel_impl: str = "fsdp2"
    """Data-parallel implementation: fsdp2 (torch's fully_shard) or simple_fsdp."""
    fsdp_reshard_after_forward: str = "default"
    """Free gathered parameters after forward: default (always, except under pipeline parallel),
    always or never."""
    enable_loss_parallel: bool = True
    """Under tensor parallelism, compute the cross-entropy on the vocabulary-sharded logits."""
    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with matmuls (GPU only; needs compile)."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble."""
    pipeline_parallel_layers_per_stage: typing.Optional[int] = None
    """Transformer blocks per (virtual) stage; unset = layers split evenly, one stage per rank
    (two for the interleaved and V schedules)."""
    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Explicit stage boundaries, e.g. 'layers.2,layers.4': each named layer starts a stage."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline microbatch; the local batch is split into microbatches of this size."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints and resume from the newest complete one at start."""
    folder: str = "checkpoint"
    """Checkpoint folder inside the dump folder; each checkpoint is a step-N sub-folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    async_mode: str = "disabled"
    """disabled (training waits for the save), async (a background thread writes while training
    continues) or async_with_pinned_mem (staging into pinned memory, on accelerators)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints, deleting older ones in the background; 0 = keep all."""
    load_step: int = -1
    """Resume from step-N exactly instead of the newest complete checkpoint; -1 = the newest."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts not restored on resume: any of model, optimizer, lr_scheduler, dataloader, train_state."""
    initial_load_path: str = ""
    """When there is no checkpoint to resume from: load model weights only from this DCP checkpoint
    folder (e.g. a seed checkpoint's step-0) or Hugging Face safetensors folder (fine-tuning)."""
    create_seed_checkpoint: bool = False
    """On 1 rank: write the initialized model as <folder>/step-0 and exit; loadable at any layout."""
    export_hf: bool = False
    """At the last step, also write the model in Hugging Face's Llama safetensors layout to <folder>/hf."""
    export_dtype: str = "float32"
    """Dtype of the Hugging Face export: float32, bfloat16 or float16."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """Recompute activations in backward: none, full (every block) or selective."""
    selective_ac_option: str = "op"
    """For selective mode: 'op' (save compute-heavy ops) or N (checkpoint every N-th block)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the model (per transformer block for fsdp2, whole model for simple_fsdp) and,
    without tensor parallelism, the loss."""
    backend: str = "inductor"
    """torch.compile backend: inductor or aot_eager."""
    bucketing: str = "manual"
    """SimpleFSDP collective bucketing in the compiled graph: none (one all-gather and one
    reduce-scatter per parameter), manual (compile.manual_buckets) or auto (the greedy planner)."""
    manual_buckets: list[str] = field(default_factory=list)
    """Buckets for manual bucketing, each a '+'-joined list of module-name patterns
    (e.g. 'layers.0+layers.1', 'norm+output'); empty = one bucket per transformer block,
    tok_embeddings, and norm+output."""
    bucket_memory_cap_mb: float = 1024.0
    """Auto bucketing: most megabytes of gathered weights that two neighbouring buckets may hold."""
    compute_flops: typing.Optional[float] = None
    """Auto bucketing: FLOP/s one rank achieves; unset = measured by a matmul benchmark."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at the first and last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard event files under <dump_folder>/<save_tb_folder>/<run_name>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside the dump folder."""
    peak_flops: typing.Optional[float] = None
    """Peak FLOP/s of one device for MFU; unset = known GPU table or a CPU matmul benchmark."""


@dataclass
class Comm:
    alpha_us: typing.Optional[float] = None
    """Latency of one collective in microseconds for the auto bucket planner; unset (with
    bandwidth_gbps) = calibrated at start by timing all-gathers on the data-parallel group."""
    bandwidth_gbps: typing.Optional[float] = None
    """Collective bandwidth in GB/s (bytes, not bits) for the auto bucket planner; unset = calibrated."""
    init_timeout_seconds: int = 300
    """Timeout of collectives during initialization (first step included)."""
    train_timeout_seconds: int = 100
    """Timeout of collectives once training runs; a hung rank ends the job with an error."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""
    save_traces_folder: str = "profile_traces"
    """Trace folder inside the dump folder."""
    profile_freq: int = 10
    """Record a trace every this many steps."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on a held-out dataset."""
    dataset: str = "python_docs"
    """Validation corpus, same forms as training.dataset."""
    freq: int = 10
    """Validate every this many steps."""
    steps: int = 4
    """Batches per validation."""


@dataclass
class Debug:
    seed: int = 0
    """Seed of model initialization and data order."""
    deterministic: bool = False
    """Use deterministic algorithms so two runs give bitwise-equal losses."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic collection is off); 0 = leave gc alone."""
    fail_at_step: int = -1
    """Failure injection for tests, on the first attempt only (before any torchrun restart): at this
    step the last rank does what debug.failure says; -1 = never."""
    failure: str = "kill"
    """What debug.fail_at_step injects: kill (SIGKILL), hang (sleep forever), kill_during_save (die
    while writing that step's checkpoint) or nan (non-finite gradients)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES: dict[str, tuple[str, ...]] = {
    "training.mixed_precision_param": ("float32", "bfloat16"),
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "training.nonfinite_policy": ("error", "skip_step", "rollback"),
    "checkpoint.async_mode": ("disabled", "async", "async_with_pinned_mem"),
    "checkpoint.export_dtype": ("float32", "bfloat16", "float16"),
    "debug.failure": ("kill", "hang", "kill_during_save", "nan"),
    "optimizer.name": ("AdamW", "Adam"),
    "optimizer.implementation": ("foreach", "fused", "for-loop"),
    "lr_scheduler.decay_type": ("linear", "cosine", "sqrt"),
    "parallelism.data_parallel_impl": ("fsdp2", "simple_fsdp"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "parallelism.pipeline_parallel_schedule": (
        "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    ),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "compile.backend": ("inductor", "aot_eager"),
    "compile.bucketing": ("none", "manual", "auto"),
}


# ---------------------------------------------------------------------------------------------
# Introspection: field types and docstrings


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(tp: typing.Any) -> str:
    inner, optional = _unwrap_optional(tp)
    name = _list_item_type(inner).__name__ + " list" if _is_list(inner) else inner.__name__
    return name + " (optional)" if optional else name


def _unwrap_optional(tp: typing.Any) -> tuple[typing.Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _is_list(tp: typing.Any) -> bool:
    return typing.get_origin(tp) is list


def _list_item_type(tp: typing.Any) -> type:
    return typing.get_args(tp)[0]


# ---------------------------------------------------------------------------------------------
# Value conversion


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, value: typing.Any, tp: typing.Any, from_cli: bool) -> typing.Any:
    """Converts a CLI string (or a TOML value, which must already have the right type) to the
    field's type, or raises ConfigError."""
    inner, optional = _unwrap_optional(tp)
    if not from_cli and isinstance(value, str) and inner is not str and not _is_list(inner):
        raise ConfigError(f"{key}: expected {_type_name(inner)}, got the string {value!r}")
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("", "none"))):
        return None
    if _is_list(inner):
        item_type = _list_item_type(inner)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {item_type.__name__}, got {value!r}")
        return [_convert(key, v, item_type, from_cli) for v in value]
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if inner is int:
        if isinstance(value, bool) or isinstance(value, float):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if inner is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if inner is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp} for {key}")


def _suggest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> list[str]:
    return [
        f"{section}.{f.name}"
        for section, cls in _sections().items()
        for f in dataclasses.fields(cls)
    ]


def _set(config: JobConfig, key: str, raw: typing.Any, origin: str = "") -> None:
    """Sets one option; ``origin`` names the TOML file it came from (empty for the CLI)."""
    section_name, _, field_name = key.partition(".")
    sections = _sections()
    if section_name not in sections or not field_name:
        raise ConfigError(f"unknown option '{key}'{origin}{_suggest(key, _all_keys())}")
    cls = sections[section_name]
    hints = typing.get_type_hints(cls)
    if field_name not in hints:
        raise ConfigError(f"unknown option '{key}'{origin}{_suggest(key, _all_keys())}")
    try:
        value = _convert(key, raw, hints[field_name], from_cli=not origin)
    except ConfigError as e:
        raise ConfigError(f"{e}{origin}") from None
    setattr(getattr(config, section_name), field_name, value)


# ---------------------------------------------------------------------------------------------
# Loading


def _parse_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """Splits ``--a.b v``, ``--a.b=v`` and bare ``--flag`` into (key, value-or-None) pairs."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        if eq:
            pairs.append((key, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 2
        else:
            pairs.append((key, None))
            i += 1
    return pairs


def _field_type(key: str) -> typing.Any:
    section_name, _, field_name = key.partition(".")
    cls = _sections().get(section_name)
    return typing.get_type_hints(cls).get(field_name) if cls else None


def load_config(argv: list[str]) -> JobConfig:
    """Builds the job config from defaults, the TOML file named by --job.config_file, then the
    other command-line options. Raises ConfigError for any bad input."""
    pairs = _parse_cli(argv)
    for key, value in pairs:
        if value is None and _unwrap_optional(_field_type(key) or str)[0] is not bool:
            if _field_type(key) is None:
                raise ConfigError(f"unknown option '--{key}'{_suggest(key, _all_keys())}")
            raise ConfigError(f"--{key} needs a value")

    config = JobConfig()
    config_file = next((v for k, v in pairs if k == "job.config_file"), None)
    if config_file:
        _apply_toml(config, config_file)
    for key, value in pairs:
        _set(config, key, True if value is None else value)
    validate(config)
    return config


def _apply_toml(config: JobConfig, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path} (--job.config_file)")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for section_name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: '{section_name}' must be a [section] table"
                f"{_suggest(section_name, _sections())}"
            )
        if section_name not in _sections():
            raise ConfigError(
                f"{path}: unknown section [{section_name}]{_suggest(section_name, _sections())}"
            )
        for field_name, value in table.items():
            _set(config, f"{section_name}.{field_name}", value, origin=f" in {path}")
    config.job.config_file = path


def validate(config: JobConfig) -> None:
    """Checks value ranges and choices that do not depend on the world size."""
    for key, choices in CHOICES.items():
        section_name, _, field_name = key.partition(".")
        value = getattr(getattr(config, section_name), field_name)
        if value not in choices:
            raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}")
    positive = {
        "training.seq_len": config.training.seq_len,
        "training.local_batch_size": config.training.local_batch_size,
        "training.steps": config.training.steps,
        "metrics.log_freq": config.metrics.log_freq,
        "optimizer.lr": config.optimizer.lr,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    p = config.parallelism
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree must be -1 or >= 1, got {p.data_parallel_shard_degree}"
        )
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        if not ac.selective_ac_option.isdigit() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option: '{ac.selective_ac_option}' "
                "is neither 'op' nor a positive integer"
            )
    _validate_checkpoint(config)
    if (config.comm.alpha_us is None) != (config.comm.bandwidth_gbps is None):
        raise ConfigError("comm.alpha_us and comm.bandwidth_gbps go together: set both or neither (calibrate)")
    lr = config.lr_scheduler
    if lr.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {lr.warmup_steps}")
    if lr.warmup_steps > config.training.steps:
        raise ConfigError(
            f"lr_scheduler.warmup_steps {lr.warmup_steps} exceeds training.steps {config.training.steps}"
        )
    if lr.decay_ratio is not None and not 0.0 <= lr.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1], got {lr.decay_ratio}")


CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


def _validate_checkpoint(config: JobConfig) -> None:
    ckpt = config.checkpoint
    if ckpt.interval <= 0:
        raise ConfigError(f"checkpoint.interval must be positive, got {ckpt.interval}")
    if ckpt.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {ckpt.keep_latest_k}")
    if ckpt.load_step < -1:
        raise ConfigError(f"checkpoint.load_step must be -1 (newest) or a step >= 0, got {ckpt.load_step}")
    for part in ckpt.exclude_from_loading:
        if part not in CHECKPOINT_PARTS:
            raise ConfigError(
                f"checkpoint.exclude_from_loading: '{part}' is not one of {', '.join(CHECKPOINT_PARTS)}"
                f"{_suggest(part, CHECKPOINT_PARTS)}"
            )
    needs_enable = {
        "create_seed_checkpoint": ckpt.create_seed_checkpoint,
        "load_step": ckpt.load_step != -1,
        "export_hf": ckpt.export_hf,
    }
    for option, used in needs_enable.items():
        if used and not ckpt.enable:
            raise ConfigError(f"checkpoint.{option} needs checkpoint.enable")
    if config.training.nonfinite_policy == "rollback" and not ckpt.enable:
        raise ConfigError("training.nonfinite_policy: 'rollback' needs checkpoint.enable")
    if ckpt.create_seed_checkpoint and config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("checkpoint.create_seed_checkpoint: run it on 1 rank without pipeline parallelism")


def help_text() -> str:
    """Every option with its type, default and documentation."""
    lines = [
        "usage: train.py [--job.config_file FILE.toml] [--section.field VALUE ...]",
        "",
        "Options (TOML keys are the same names inside [section] tables):",
    ]
    defaults = JobConfig()
    for section_name, cls in _sections().items():
        lines.append(f"\n[{section_name}]")
        hints = typing.get_type_hints(cls)
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{section_name}.{f.name}"
            default = getattr(getattr(defaults, section_name), f.name)
            choices = CHOICES.get(key)
            lines.append(f"  --{key} {_type_name(hints[f.name])} (default: {default!r})")
            doc = docs.get(f.name, "")
            if choices:
                doc += f" Choices: {', '.join(choices)}."
            lines.extend("      " + line for line in textwrap.wrap(doc, 90))
    return "\n".join(lines)


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (unset optional values are left out)."""

    def render(value: typing.Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, list):
            return "[" + ", ".join(render(v) for v in value) + "]"
        return repr(value)

    lines = []
    for section_name, values in config.to_dict().items():
        lines.append(f"[{section_name}]")
        lines.extend(f"{k} = {render(v)}" for k, v in values.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


@contextlib.contextmanager
def user_input(option: str = "") -> typing.Iterator[None]:
    """Reports a bad file or value met while acting on ``option`` as a one-line ConfigError
    (without a prefix when the message already names its option)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as e:
        raise ConfigError(f"{option}: {e}" if option else str(e)) from None


def batch_layout(training: Training, dp_degree: int) -> tuple[int, int]:
    """(global batch size, gradient-accumulation microbatches) for ``dp_degree`` data-parallel ranks."""
    per_microbatch = training.local_batch_size * dp_degree
    global_batch = training.global_batch_size if training.global_batch_size > 0 else per_microbatch
    if global_batch % per_microbatch:
        raise ConfigError(
            f"training.global_batch_size {global_batch} is not divisible by "
            f"training.local_batch_size x data-parallel degree = {per_microbatch}"
        )
    return global_batch, global_batch // per_microbatch
