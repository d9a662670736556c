"""Loading the job config: defaults < TOML file < command line, then validation, ``--help`` and
the resolved config as TOML."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import os
import sys
import textwrap
import types
import typing

from config.job_config import CHECKPOINT_PARTS, ConfigError, JobConfig, Training

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

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
    name = "str" if choices_of(inner) else name
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


def choices_of(tp: typing.Any) -> tuple[str, ...]:
    """The values a ``Literal[...]`` field accepts; empty for any other type."""
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


# ---------------------------------------------------------------------------------------------
# Value conversion


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, value: typing.Any, tp: typing.Any, from_cli: bool) -> typing.Any:
    """Converts a CLI string (or a TOML value, which must already have the right type) to the
    field's type, or raises ConfigError."""
    inner, optional = _unwrap_optional(tp)
    choices = choices_of(inner)
    if not from_cli and isinstance(value, str) and inner is not str and not choices and not _is_list(inner):
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
    if choices and value not in choices:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}")
    if inner is str or choices:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp} for {key}")


def _suggest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in _sections().items() for f in dataclasses.fields(cls)]


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
                f"{path}: '{section_name}' must be a [section] table{_suggest(section_name, _sections())}"
            )
        if section_name not in _sections():
            raise ConfigError(f"{path}: unknown section [{section_name}]{_suggest(section_name, _sections())}")
        for field_name, value in table.items():
            _set(config, f"{section_name}.{field_name}", value, origin=f" in {path}")
    config.job.config_file = path


def validate(config: JobConfig) -> None:
    """Checks value ranges that do not depend on the world size (choices are checked on loading)."""
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
        raise ConfigError(f"lr_scheduler.warmup_steps {lr.warmup_steps} exceeds training.steps {config.training.steps}")
    if lr.decay_ratio is not None and not 0.0 <= lr.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1], got {lr.decay_ratio}")


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
            choices = choices_of(hints[f.name])
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
