"""Loading the job config: defaults < TOML file < command line, then validation, ``--help`` and
the resolved config as TOML."""

from __future__ import annotations

import ast
import collections
import dataclasses
import difflib
import functools
import inspect
import logging
import math
import os
import re
import sys
import textwrap
import types
import typing

from config import torchtitan
from config.job_config import (
    CHECKPOINT_PARTS,
    DEFAULT_TOKENIZER_MIN_VOCAB,
    MAX_LAYERS,
    MAX_MODEL_SIZE,
    MODEL_SIZE_FIELDS,
    ConfigError,
    Float8,
    Job,
    JobConfig,
    Model,
    Parallelism,
    Training,
    Validation,
    written_by_a_run,
)

logger = logging.getLogger(__name__)

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
    name = _type_name(_list_item_type(inner)) + " list" if _is_list(inner) else inner.__name__
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
            if _is_list(item_type):  # a list of lists on the command line: 'a+b,c'
                value = [[w.strip() for w in v.split("+")] for v in value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {_type_name(item_type)}, got {value!r}")
        if _is_list(item_type) and not all(isinstance(v, list) for v in value):
            # A flat TOML list would be read as one list per name (for stages: a stage per module).
            raise ConfigError(f"{key}: expected a list of lists ([[...], [...]]), got {value!r}")
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
        _check_text(key, value)
        # A home-relative path reaches us unexpanded from TOML and from --option=~/x.
        return os.path.expanduser(value) if value.startswith("~") else value
    raise TypeError(f"unsupported config field type {tp} for {key}")


def _check_text(key: str, value: str) -> None:
    """A string the resolved config.toml can hold and the OS can take as a path or name."""
    if "\0" in value:
        raise ConfigError(f"{key}: holds a NUL character, which no path or name can")
    try:
        value.encode()
    except UnicodeEncodeError:  # bytes of another encoding on the command line, kept as surrogates
        raise ConfigError(f"{key}: {value!r} is not valid UTF-8") from None


def _suggest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in _sections().items() for f in dataclasses.fields(cls)]


def _field_type(key: str) -> typing.Any:
    section_name, _, field_name = key.partition(".")
    cls = _sections().get(section_name)
    return typing.get_type_hints(cls).get(field_name) if cls else None


def _set(config: JobConfig, key: str, raw: typing.Any, origin: str) -> None:
    """Sets the Tessera option ``key``; ``origin`` names the TOML file it came from (empty: CLI)."""
    try:
        value = _convert(key, raw, _field_type(key), from_cli=not origin)
    except ConfigError as e:
        raise ConfigError(f"{e}{origin}") from None
    section_name, _, field_name = key.partition(".")
    setattr(getattr(config, section_name), field_name, value)


# ---------------------------------------------------------------------------------------------
# Loading


def _parse_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """Splits ``--a.b v``, ``--a.b=v`` and bare ``--flag`` into (key, value-or-None) pairs; dashes
    in names read as underscores (``--training.local-batch-size``)."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
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


def _flatten(table: dict, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, value) of every leaf of a TOML table: [quantize.linear.float8] nests three deep."""
    leaves = []
    for name, value in table.items():
        if isinstance(value, dict):
            leaves.extend(_flatten(value, f"{prefix}{name}."))
        else:
            leaves.append((f"{prefix}{name}", value))
    return leaves


def _read_toml(path: str) -> list[tuple[str, typing.Any]]:
    if os.path.isdir(path):
        raise ConfigError(f"config file is a folder: {path} (--job.config_file)")
    if os.path.exists(path) and not os.path.isfile(path):  # /dev/null, a pipe: read once, or empty
        raise ConfigError(f"config file is not a regular file: {path} (--job.config_file)")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path} (--job.config_file)")
    try:
        with open(path, "rb") as f:
            # utf-8-sig: editors on Windows begin files with a byte-order mark, which TOML does not allow.
            return _flatten(tomllib.loads(f.read().decode("utf-8-sig")))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it: {e}") from None
    except ValueError as e:  # TOML's own errors, and an integer of more digits than Python converts
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None


def _config_file(pairs: list[tuple[str, str | None]]) -> str | None:
    """The TOML file the command line's options name (the last --job.config_file given), if any."""
    return next((v for k, v in reversed(pairs) if k == "job.config_file"), None)


def load_config(argv: list[str]) -> JobConfig:
    """Builds the job config from defaults, the TOML file named by --job.config_file (the last
    one given), then the other command-line options, torchtitan's names included. Raises
    ConfigError for any bad input; every unknown option is named in the same message."""
    pairs = [_negated_flag(key, value) for key, value in _parse_cli(argv)]
    given = collections.Counter(key for key, _ in pairs)
    if repeated := [f"--{key} ({n} times)" for key, n in given.items() if n > 1]:
        logger.warning("given more than once, the last counts: %s", ", ".join(repeated))
    for key, value in pairs:
        field_type = _field_type(torchtitan.ALIASES.get(key, key))
        if value is None and field_type is not None and _unwrap_optional(field_type)[0] is not bool:
            raise ConfigError(f"--{key} needs a value")
    config_file = _config_file(pairs)
    if config_file is not None:
        if not config_file.strip():
            raise ConfigError("job.config_file: no file given (leave the option out for the defaults alone)")
        _check_text("job.config_file", config_file)
    file_settings = _read_toml(config_file) if config_file else []
    sources = [(file_settings, f" in {config_file}")] if config_file else []
    # A run's resolved config names the file it was made from; any other file thinks it reads one.
    if (nested := dict(file_settings).get("job.config_file")) and not written_by_a_run(config_file):
        logger.warning(
            "job.config_file = %r in %s has no effect: a config file does not read another "
            "(the command line's --job.config_file names the one file read)",
            nested,
            config_file,
        )
    last = {k: True if v is None else v for k, v in pairs if k != "job.config_file"}  # the last counts
    sources.append((list(last.items()), ""))
    config, unknown, foreign = JobConfig(), [], {}
    for settings, origin in sources:
        _apply_source(config, settings, origin, unknown, foreign)
    if unknown:
        raise ConfigError("; ".join(dict.fromkeys(unknown)))
    if config_file:
        config.job.config_file = config_file
    _check_foreign(foreign)
    validate(config)
    _warn_no_effect(config, typed_options(argv))
    return config


def named_as_given(error: ConfigError, argv: list[str]) -> ConfigError:
    """``error`` with each option the user set by one of torchtitan's names (on the command line
    ``argv`` or in the config file it names) called by that name, the one the user knows."""
    try:
        pairs = _parse_cli(argv)
        config_file = _config_file(pairs)
        file_keys = [key for key, _ in _read_toml(config_file)] if config_file else []
    except ConfigError:  # unreadable: the error says so, naming no option
        return error
    cli_keys = [key for key, _ in pairs]
    aliases = torchtitan.ALIASES

    def alias_names(keys: list[str]) -> dict[str, str]:
        # An option given by both names in one source (a contradiction's line names both) keeps its name.
        return {aliases[key]: key for key in keys if key in aliases and aliases[key] not in keys}

    names = alias_names(file_keys)
    for option in {aliases.get(key, key) for key in cli_keys}:  # the command line's value, and name, win
        names.pop(option, None)
    names.update(alias_names(cli_keys))
    if not names:
        return error
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?![\w.])")
    return ConfigError(pattern.sub(lambda match: names[match.group(1)], str(error)))


def typed_options(argv: list[str]) -> set[str]:
    """The options named on the command line ``argv``, by Tessera's names."""
    pairs = [_negated_flag(key, value) for key, value in _parse_cli(argv)]
    return {torchtitan.ALIASES.get(key, key) for key, _ in pairs}


def warn_no_effect_at_degrees(
    config: JobConfig, typed: typing.AbstractSet[str], dp_replicate: int, dp_shard: int
) -> None:
    """One warning line for the options in ``typed`` that do nothing at these data-parallel
    degrees: what shards or reduces gradients with one data-parallel rank."""
    reasons: dict[str, str] = {}
    if dp_shard == 1:
        sharded = ["parallelism.fsdp_reshard_after_forward", "float8.enable_fsdp_float8_all_gather"]
        sharded.append("float8.precompute_float8_dynamic_scale_for_fsdp")
        reasons.update(dict.fromkeys(sharded, "no sharded data parallelism: the data-parallel shard degree is 1"))
    if dp_replicate * dp_shard == 1:
        # Without data parallelism SimpleFSDP compiles the whole model without buckets, whatever the plan.
        unreduced = ["training.mixed_precision_reduce", "compile.manual_buckets", "compile.bucket_memory_cap_mb"]
        unreduced += ["compile.compute_flops"] + ["compile.bucketing"] * (config.compile.bucketing != "block")
        reasons.update(dict.fromkeys(unreduced, "no data parallelism: one data-parallel rank"))
    named = typed & reasons.keys() - _no_effect(config).keys()  # those load_config named already
    if ignored := [f"--{key} ({reasons[key]})" for key in sorted(named)]:
        logger.warning("no effect in this run: %s", "; ".join(ignored))


def _negated_flag(key: str, value: str | None) -> tuple[str, str | None]:
    """torchtitan's bare ``--section.no_flag`` as ``--section.flag false``."""
    section, _, name = key.rpartition(".")
    flag = f"{section}.{name[3:]}"
    known = _field_type(flag) is not None or any(
        flag in names for names in (torchtitan.ALIASES, torchtitan.NEGATED, torchtitan.FOREIGN)
    )
    return (flag, "false") if value is None and name.startswith("no_") and known else (key, value)


def _apply_source(config: JobConfig, settings: list, origin: str, unknown: list, foreign: dict) -> None:
    """Applies one file's or the command line's settings. An option given under Tessera's name and
    torchtitan's with values that disagree is a ConfigError: neither can be taken for the intent."""
    seen: dict[str, tuple[str, typing.Any]] = {}  # Tessera option: (name given, value it set)
    # torchtitan's renamed options after the direct ones: dataset_path wins over dataset.
    for key, value in sorted(settings, key=lambda kv: kv[0] in torchtitan.ALIASES):
        target = _apply(config, key, value, origin, unknown, foreign)
        if target is None or key in torchtitan.OVERRIDING:
            continue
        section_name, _, field_name = target.partition(".")
        now = getattr(getattr(config, section_name), field_name)
        if target in seen and seen[target][1] != now:
            raise ConfigError(_disagreement(*seen[target], key, now, origin))
        seen[target] = (key, now)


def _disagreement(first: str, first_value: typing.Any, second: str, second_value: typing.Any, origin: str) -> str:
    """The line for one option given under two names with values that disagree."""
    prefix = "" if origin else "--"
    shown = [
        f"{prefix}{key} {_toml_value(not value if key in torchtitan.NEGATED else value)}"
        for key, value in ((first, first_value), (second, second_value))
    ]
    why = (
        "the same option twice; give it once"
        if first == second
        else "one option by Tessera's and torchtitan's names; give one"
    )
    return f"{shown[0]} and {shown[1]}{origin} contradict each other: {why}"


def _apply(config: JobConfig, key: str, value: typing.Any, origin: str, unknown: list, foreign: dict) -> str | None:
    """Sets one setting, by its Tessera or torchtitan name, and returns the Tessera option it set;
    records what is unknown or foreign."""
    if key in torchtitan.NEGATED:
        key, value = torchtitan.NEGATED[key], _convert(key, value, bool, not origin) is False
    key = torchtitan.ALIASES.get(key, key)
    if _field_type(key) is not None:
        _set(config, key, value, origin)
        return key
    if key in torchtitan.FOREIGN:
        foreign[key] = value
    else:
        unknown.append(_unknown(key, origin))
    return None


def _unknown(key: str, origin: str) -> str:
    """What to say about a name that is neither Tessera's nor torchtitan's."""
    section = key.split(".")[0]
    if "." not in key:
        if key in _sections():  # [[training]]: an array of tables
            return f"'{key}' must be one [{key}] table, not [[{key}]] or a value{origin}"
        return f"'{key}' must be a [section] table{_suggest(key, _sections())}{origin}"
    if origin and section not in _sections() and not any(k.startswith(section + ".") for k in torchtitan.FOREIGN):
        return f"unknown section [{section}]{_suggest(section, _sections())}{origin}"
    return f"unknown option '{key}'{origin}{_suggest(key, _all_keys())}"


def _check_foreign(foreign: dict[str, typing.Any]) -> None:
    """One line for torchtitan options of features Tessera lacks: an error when the run cannot go
    without the feature, else a warning; one warning line for the others (left at no effect)."""
    foreign = {key: _as_neutral_type(key, value) for key, value in foreign.items()}
    wanted = {key: value for key, value in foreign.items() if torchtitan.asks_for_feature(key, value)}
    if blocking := wanted.keys() & torchtitan.CHANGES_THE_RUN.keys():
        missing = ", ".join(f"{key}={value!r}" for key, value in wanted.items())
        instead = "".join(torchtitan.CHANGES_THE_RUN[key] for key in sorted(blocking))
        raise ConfigError(f"not available in Tessera: {missing}{instead}")
    if wanted:
        missing = ", ".join(f"{key}={value!r}" for key, value in wanted.items())
        logger.warning("not available in Tessera, training without them: %s", missing)
    if ignored := sorted(foreign.keys() - wanted.keys()):
        logger.warning("torchtitan options with no effect in Tessera, ignored: %s", ", ".join(ignored))


def _as_neutral_type(key: str, value: typing.Any) -> typing.Any:
    """A command line's string for a foreign option, read as its neutral value's type ('1' as 1,
    'false' as False), so that the value leaving the feature off is known as such."""
    neutral = torchtitan.FOREIGN[key]
    if not isinstance(value, str) or neutral is torchtitan.ANY or isinstance(neutral, str):
        return value
    try:
        return _convert(key, value, type(neutral), from_cli=True)
    except ConfigError:
        return value  # not of the type: named as given, asking for the feature


def _no_effect(c: JobConfig) -> dict[str, str]:
    """option: why it does nothing in this run (a switch it depends on is off)."""
    reasons: dict[str, str] = {}

    def inert(section: str, names: typing.Iterable[str], why: str) -> None:
        reasons.update({f"{section}.{name}": why for name in names if f"{section}.{name}" not in reasons})

    ck, ac, prof = c.checkpoint, c.activation_checkpoint, c.profiling
    _no_effect_in_checkpoint_and_compile(c, inert)
    if "float8" not in c.model.converters:
        inert("float8", (f.name for f in dataclasses.fields(Float8)), "model.converters has no float8")
    if ac.mode != "selective":
        inert("activation_checkpoint", ("selective_ac_option",), f"activation_checkpoint.mode is {ac.mode}")
    if ac.mode != "memory_budget":
        inert("activation_checkpoint", ("memory_budget",), f"activation_checkpoint.mode is {ac.mode}")
    if ac.mode in ("none", "memory_budget"):  # no block is wrapped in torch's checkpoint
        recompute = ("early_stop", "preserve_rng_state", "determinism_check", "debug")
        inert("activation_checkpoint", recompute, f"activation_checkpoint.mode is {ac.mode}")
    if c.parallelism.pipeline_parallel_degree == 1:
        names = [f.name for f in dataclasses.fields(Parallelism) if f.name.startswith("pipeline_parallel_")]
        pipeline = [n for n in names if n != "pipeline_parallel_degree"] + ["module_fqns_per_model_part"]
        inert("parallelism", pipeline, "no pipeline parallelism")
    if (split := c.parallelism.pipeline_parallel_split_points) or c.parallelism.module_fqns_per_model_part:
        given = "pipeline_parallel_split_points" if split else "module_fqns_per_model_part"
        inert("parallelism", PIPELINE_END_WEIGHTS, f"parallelism.{given} gives the stages")
    if c.parallelism.tensor_parallel_degree == 1:
        inert("parallelism", ("enable_loss_parallel", "enable_async_tensor_parallel"), "no tensor parallelism")
    if not c.validation.enable:
        inert(
            "validation",
            (f.name for f in dataclasses.fields(Validation) if f.name != "enable"),
            "validation.enable is false",
        )
    if not prof.enable_profiling:
        inert(
            "profiling",
            ("save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup"),
            "profiling.enable_profiling is false",
        )
    if not prof.enable_memory_snapshot:
        inert("profiling", ("save_memory_snapshot_folder",), "profiling.enable_memory_snapshot is false")
    if not c.metrics.enable_tensorboard:
        inert("metrics", ("save_tb_folder",), "metrics.enable_tensorboard is false")
    if not c.metrics.enable_tensorboard and not c.metrics.enable_wandb:
        inert("metrics", ("save_for_all_ranks",), "metrics.enable_tensorboard and metrics.enable_wandb are false")
    if not c.debug.deterministic:
        inert("debug", ("deterministic_warn_only",), "debug.deterministic is false")
    if c.debug.fail_at_step < 0:
        inert("debug", ("failure",), "debug.fail_at_step is -1")
    if c.debug.failure.endswith("_during_save") and not ck.enable:
        inert("debug", ("fail_at_step", "failure"), f"debug.failure {c.debug.failure} without checkpoint.enable")
    return reasons


def _no_effect_in_checkpoint_and_compile(c: JobConfig, inert: typing.Callable[..., None]) -> None:
    """_no_effect's reasons for [checkpoint] and [compile] options, through its ``inert``."""
    ck, comp = c.checkpoint, c.compile
    if not ck.enable:
        inert(
            "checkpoint",
            ("folder", "interval", "async_mode", "keep_latest_k", "export_dtype"),
            "checkpoint.enable is false",
        )
    if ck.load_only:
        inert("checkpoint", ("interval", "async_mode", "keep_latest_k"), "checkpoint.load_only saves nothing")
    if not ck.export_hf:
        inert("checkpoint", ("export_dtype",), "checkpoint.export_hf is false")
    if not ck.initial_load_path:
        inert("checkpoint", ("initial_load_model_only",), "no checkpoint.initial_load_path")
    if not ck.enable and (not ck.initial_load_path or ck.initial_load_model_only):
        inert("checkpoint", ("exclude_from_loading",), "nothing loads but model weights")
    simple_fsdp_options = ("bucketing", "manual_buckets", "bucket_memory_cap_mb", "compute_flops")
    if not comp.enable:
        inert("compile", ("components", "backend", *simple_fsdp_options), "compile.enable is false")
    if not comp.compiles_model:  # SimpleFSDP's buckets are made in the model's graph
        inert("compile", simple_fsdp_options, "compile.components has no model")
    if c.parallelism.data_parallel_impl != "simple_fsdp":
        inert("compile", simple_fsdp_options, f"parallelism.data_parallel_impl is {c.parallelism.data_parallel_impl}")
    if comp.bucketing != "manual":
        inert("compile", ("manual_buckets",), f"compile.bucketing is {comp.bucketing}")
    if comp.bucketing != "auto":
        inert("compile", ("bucket_memory_cap_mb", "compute_flops"), f"compile.bucketing is {comp.bucketing}")


def _warn_no_effect(config: JobConfig, given: set[str]) -> None:
    """One warning line for the command-line options this run ignores (torchtitan's files set
    many such options, so only the ones typed are named), and for windows longer than the run or
    an LR schedule shorter than it."""
    reasons = _no_effect(config)
    if ignored := [f"--{key} ({reasons[key]})" for key in sorted(given & reasons.keys())]:
        logger.warning("no effect in this run: %s", "; ".join(ignored))
    ck = config.checkpoint
    if ck.enable and not ck.export_hf and ck.export_dtype != "float32" and "checkpoint.export_dtype" not in given:
        # Set in a file (typed, the line above names it): torchtitan would save its last checkpoint
        # model-only in this dtype, which Tessera's whole last checkpoint does not.
        logger.warning(
            "checkpoint.export_dtype %s is the dtype of the Hugging Face export alone (checkpoint.export_hf), "
            "which is off: the last checkpoint is saved whole, as trained",
            ck.export_dtype,
        )
    steps = config.training.steps
    windows = {"validation.freq": (config.validation.enable, config.validation.freq, "only validation after step 1")}
    windows["profiling.profile_freq"] = (config.profiling.enable_profiling, config.profiling.profile_freq, "no trace")
    windows["debug.fail_at_step"] = (config.debug.fail_at_step >= 0, config.debug.fail_at_step, "no injected failure")
    for key, (enabled, freq, what) in windows.items():
        if enabled and freq > steps:
            logger.warning("%s %d is more than training.steps %d: %s in this run", key, freq, steps, what)
    schedule = config.lr_scheduler.total_steps
    if schedule is not None and schedule < steps:
        logger.warning(
            "lr_scheduler.total_steps %d is less than training.steps %d: steps %d to %d train at the final "
            "learning rate",
            schedule,
            steps,
            schedule + 1,
            steps,
        )


# The blocks the first and last pipeline stages count their embeddings and output as.
PIPELINE_END_WEIGHTS = ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers")


def validate(config: JobConfig) -> None:
    """Checks value ranges that do not depend on the world size (choices are checked on loading;
    the optimizer's and the LR schedule's values when they are built)."""
    _validate_magnitudes(config)
    c = config
    at_least = {  # option: (value, smallest allowed)
        "training.seq_len": (c.training.seq_len, 1),
        "training.local_batch_size": (c.training.local_batch_size, 1),
        "training.steps": (c.training.steps, 1),
        "training.max_norm": (c.training.max_norm, 0),
        "training.dataloader_num_workers": (c.training.dataloader_num_workers, 0),
        "metrics.log_freq": (c.metrics.log_freq, 1),
        "profiling.profile_freq": (c.profiling.profile_freq, 1),
        "profiling.profiler_active": (c.profiling.profiler_active, 1),
        "profiling.profiler_warmup": (c.profiling.profiler_warmup, 0),
        "debug.gc_freq": (c.debug.gc_freq, 0),
        **{f"parallelism.{name}": (getattr(c.parallelism, name), 0) for name in PIPELINE_END_WEIGHTS},
        **{f"comm.{name}": (getattr(c.comm, name), 1) for name in ("init_timeout_seconds", "train_timeout_seconds")},
        "comm.trace_buf_size": (c.comm.trace_buf_size, 0),
        **_validation_counts(c.validation),
    }
    for key, (value, smallest) in at_least.items():
        if value < smallest:
            raise ConfigError(f"{key} must be {'positive' if smallest == 1 else '>= 0'}, got {value}")
    # Every size but the two switches (use_rope_scaling, tie_word_embeddings) must be positive when set.
    sizes = {f"model.{n}": v for n in MODEL_SIZE_FIELDS if not isinstance(v := getattr(c.model, n), bool)}
    rates = {"metrics.peak_flops": c.metrics.peak_flops, "compile.compute_flops": c.compile.compute_flops, **sizes}
    for key, value in {**rates, "compile.bucket_memory_cap_mb": c.compile.bucket_memory_cap_mb}.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    _validate_model(c.model)
    if c.profiling.profiler_active > c.profiling.profile_freq:
        raise ConfigError(
            f"profiling.profiler_active {c.profiling.profiler_active} is more steps than a window of "
            f"profiling.profile_freq {c.profiling.profile_freq}"
        )
    if c.training.dtype == "bfloat16" and c.training.mixed_precision_param == "float32":
        raise ConfigError(
            "training.mixed_precision_param: float32 compute of the bfloat16 weights of training.dtype bfloat16; "
            "leave it auto or set bfloat16"
        )
    if c.training.global_batch_size == 0 or c.training.global_batch_size < -1:
        raise ConfigError(f"training.global_batch_size must be -1 or positive, got {c.training.global_batch_size}")
    _validate_job(config.job)
    _validate_degrees(config.parallelism)
    _validate_early_step(config)
    _validate_float8(config)
    _validate_activation_checkpoint(config)
    _validate_checkpoint(config)
    _validate_validation(config)
    _validate_compile_and_comm(config)
    lr = config.lr_scheduler
    if lr.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {lr.warmup_steps}")
    if lr.decay_ratio is not None and not 0.0 <= lr.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1], got {lr.decay_ratio}")


def _validate_model(model: Model) -> None:
    """The default tokenizer holds the default corpus's characters, and RoPE's values are usable."""
    if (vocab := model.default_tokenizer_vocab_size) < DEFAULT_TOKENIZER_MIN_VOCAB and not model.tokenizer_path:
        raise ConfigError(
            f"model.default_tokenizer_vocab_size must be at least {DEFAULT_TOKENIZER_MIN_VOCAB} (the default corpus's "
            f"characters), got {vocab}"
        )
    if model.rope_theta is not None and model.rope_theta < 1:
        # Its powers are RoPE's frequencies: below 1 they grow, past float range for tiny values.
        raise ConfigError(f"model.rope_theta must be at least 1, got {model.rope_theta}")
    low, high = model.rope_low_freq_factor, model.rope_high_freq_factor
    if low is not None and high is not None and low >= high:  # Llama 3.1's RoPE divides by high - low
        raise ConfigError(f"model.rope_low_freq_factor {low} is not below model.rope_high_freq_factor {high}")


def _validate_job(job: Job) -> None:
    """The dump folder is named, and the TensorBoard run's folder is one folder inside it."""
    _check_text("job.cache_dir (TESSERA_CACHE_DIR)", job.cache_dir)  # the environment's, unchecked
    if not job.dump_folder.strip():  # ' ' would be a folder of that name in the working folder
        raise ConfigError("job.dump_folder: no folder given ('.' is the working folder)")
    name = job.run_name
    if name and (not name.strip() or name in (".", "..") or os.sep in name):
        raise ConfigError(
            f"job.run_name: {name!r} is not a plain folder name (not blank, no '{os.sep}', not '.' or '..'); "
            "the run's TensorBoard folder goes inside job.dump_folder"
        )


def _validate_compile_and_comm(config: JobConfig) -> None:
    """Compile has something to compile; the link auto bucketing prices collectives on can be."""
    if config.compile.enable and not config.compile.components:
        raise ConfigError("compile.components: empty, so compile.enable would compile nothing; name model and/or loss")
    if (
        config.compile.enable
        and set(config.compile.components) == {"loss"}
        and config.parallelism.tensor_parallel_degree > 1
    ):
        # Loss parallel's cross-entropy runs eagerly on the vocabulary-sharded logits.
        raise ConfigError(
            "compile.components: the loss alone, which tensor parallelism runs eagerly, so compile.enable "
            "would compile nothing; add model"
        )
    comm = config.comm
    if os.sep in comm.save_traces_file_prefix:  # the flight recorder's file would be in no folder made
        raise ConfigError(
            f"comm.save_traces_file_prefix: {comm.save_traces_file_prefix!r} holds a '{os.sep}'; it begins the "
            "file names in comm.save_traces_folder, which names the folder"
        )
    if (comm.alpha_us is None) != (comm.bandwidth_gbps is None):
        raise ConfigError("comm.alpha_us and comm.bandwidth_gbps go together: set both or neither (calibrate)")
    if comm.alpha_us is not None and comm.alpha_us < 0:
        raise ConfigError(f"comm.alpha_us must be >= 0, got {comm.alpha_us}")
    if comm.bandwidth_gbps is not None and comm.bandwidth_gbps <= 0:
        raise ConfigError(f"comm.bandwidth_gbps must be positive, got {comm.bandwidth_gbps}")


def _validate_degrees(p: Parallelism) -> None:
    for key in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree must be -1 or >= 1, got {p.data_parallel_shard_degree}"
        )


def _validate_early_step(config: JobConfig) -> None:
    if not config.optimizer.early_step_in_backward:
        return
    if config.parallelism.pipeline_parallel_degree > 1:
        # The schedule runs several microbatches' backwards within one call: no step can wait for the last.
        raise ConfigError(
            "optimizer.early_step_in_backward: not with pipeline parallelism (pipeline_parallel_degree > 1)"
        )
    if config.training.nonfinite_policy == "skip_step":
        raise ConfigError(
            "training.nonfinite_policy skip_step: the update it would skip has happened in backward under "
            "optimizer.early_step_in_backward; use error or rollback"
        )
    if config.debug.failure == "nan" and config.debug.fail_at_step >= 0:
        raise ConfigError(
            "debug.failure nan: it poisons the gradients before the update, which "
            "optimizer.early_step_in_backward makes in backward"
        )


def _validate_float8(config: JobConfig) -> None:
    # torchtitan's files carry [quantize.linear.float8] whether or not model.converters asks for it.
    f8 = config.float8
    if "float8" not in config.model.converters:
        return
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather: a gather casts with one scale per weight (recipe_name "
            f"tensorwise), not with float8.recipe_name {f8.recipe_name}"
        )
    if f8.enable_fsdp_float8_all_gather and config.parallelism.data_parallel_impl != "fsdp2":
        raise ConfigError(
            "float8.enable_fsdp_float8_all_gather: FSDP2's (parallelism.data_parallel_impl fsdp2); "
            f"{config.parallelism.data_parallel_impl} gathers the weights in the compute dtype"
        )
    if "auto_filter_small_kn" in f8.filter_fqns and f8.recipe_name == "rowwise_with_gw_hp":
        raise ConfigError(
            "float8.filter_fqns: torchao's auto_filter_small_kn has thresholds for the tensorwise and rowwise "
            "recipes, not for float8.recipe_name rowwise_with_gw_hp"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        logger.warning(
            "float8.precompute_float8_dynamic_scale_for_fsdp: no effect without float8.enable_fsdp_float8_all_gather"
        )


def _validate_activation_checkpoint(config: JobConfig) -> None:
    ac = config.activation_checkpoint
    op_level = ac.mode == "selective" and ac.selective_ac_option == "op"
    if ac.mode == "selective" and not op_level:
        # isdecimal, not isdigit: int() refuses digits such as '²' that isdigit takes.
        if not ac.selective_ac_option.isdecimal() or int(ac.selective_ac_option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option: '{ac.selective_ac_option}' "
                "is neither 'op' nor a positive integer"
            )
    if ac.mode == "memory_budget" and not config.compile.compiles_model:
        raise ConfigError(
            "activation_checkpoint.mode memory_budget: the compiler picks what to recompute; set compile.enable"
        )
    if ac.mode == "memory_budget" and not 0.0 <= ac.memory_budget <= 1.0:
        raise ConfigError(f"activation_checkpoint.memory_budget must be in [0, 1], got {ac.memory_budget}")
    if ac.debug and ac.mode in ("full", "selective") and (op_level or config.compile.compiles_model):
        # torch's checkpoint refuses debug beside a selective policy, which compile also gives it.
        raise ConfigError(
            "activation_checkpoint.debug: torch records a checkpoint's ops only eagerly and without "
            "an op-level policy (not with compile.enable or selective_ac_option op)"
        )


def _validate_magnitudes(config: JobConfig) -> None:
    """Every number finite and within 64 bits, and the sizes within what torch and gloo take."""
    for section_name, cls in _sections().items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(config, section_name), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section_name}.{f.name}: {value} is not a finite number")
            if isinstance(value, int) and not -(2**63) <= value < 2**63:  # torch and C++ take 64-bit integers
                raise ConfigError(f"{section_name}.{f.name}: {value} is too large for a 64-bit integer")
    for key, (value, largest) in _upper_bounds(config).items():
        if value is not None and value > largest:
            raise ConfigError(f"{key}: {value} is more than the largest {largest:,} this run can take")


def _upper_bounds(c: JobConfig) -> dict[str, tuple[int | None, int]]:
    """option: (value, largest allowed), where a larger value would overflow in torch or gloo, or
    take minutes to be refused for its memory."""
    sizes = {
        f"model.{n}": (v, MAX_MODEL_SIZE) for n in MODEL_SIZE_FIELDS if not isinstance(v := getattr(c.model, n), bool)
    }
    timeouts = {f"comm.{n}": (getattr(c.comm, n), 10**9) for n in ("init_timeout_seconds", "train_timeout_seconds")}
    return {
        **sizes,
        "model.n_layers": (c.model.n_layers, MAX_LAYERS),
        "model.default_tokenizer_vocab_size": (c.model.default_tokenizer_vocab_size, 2**31 - 1),
        "training.seq_len": (c.training.seq_len, 2**31 - 1),
        **timeouts,  # gloo keeps timeouts in nanoseconds: 10^10 s overflows
        "comm.trace_buf_size": (c.comm.trace_buf_size, 10**7),
    }


def _validation_counts(v: Validation) -> dict[str, tuple[int, int]]:
    """validate()'s bounds of the validation counts that are set, when validation is on
    (torchtitan's files leave steps at -1, the whole set, when it is off)."""
    if not v.enable:
        return {}
    counts = {"freq": v.freq, "steps": v.steps, "local_batch_size": v.local_batch_size, "seq_len": v.seq_len}
    return {f"validation.{name}": (value, 1) for name, value in counts.items() if value is not None}


def _validate_validation(config: JobConfig) -> None:
    """A validation batch of its own shape fits the model and its parallelisms."""
    v, p, seq_len = config.validation, config.parallelism, config.validation.seq_len
    if not v.enable:
        return
    if seq_len is not None and seq_len > config.training.seq_len:
        raise ConfigError(
            f"validation.seq_len {seq_len} exceeds training.seq_len {config.training.seq_len}, "
            "the longest the model's rotary table holds"
        )
    if seq_len is not None and seq_len % p.tensor_parallel_degree:
        raise ConfigError(
            f"validation.seq_len {seq_len}: parallelism.tensor_parallel_degree {p.tensor_parallel_degree} "
            "must divide it (sequence parallel)"
        )
    training = {"local_batch_size": config.training.local_batch_size, "seq_len": config.training.seq_len}
    for name, value in training.items():
        if p.pipeline_parallel_degree > 1 and getattr(v, name) not in (None, value):
            raise ConfigError(
                f"validation.{name}: a pipeline validates with training's microbatches; "
                f"leave it unset or at training.{name} {value}"
            )


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
    if set(CHECKPOINT_PARTS) <= set(ckpt.exclude_from_loading):
        raise ConfigError(
            f"checkpoint.exclude_from_loading: every part ({', '.join(CHECKPOINT_PARTS)}), so a resume would "
            "load nothing; to start afresh, give another checkpoint.folder or job.dump_folder"
        )
    needs_enable = {
        "create_seed_checkpoint": ckpt.create_seed_checkpoint,
        "load_step": ckpt.load_step != -1,
        "export_hf": ckpt.export_hf,
        "enable_first_step_checkpoint": ckpt.enable_first_step_checkpoint,
        "load_only": ckpt.load_only,
    }
    for option, used in needs_enable.items():
        if used and not ckpt.enable:
            raise ConfigError(f"checkpoint.{option} needs checkpoint.enable")
    if ckpt.load_only:
        saves = {"create_seed_checkpoint": ckpt.create_seed_checkpoint, "export_hf": ckpt.export_hf}
        saves["enable_first_step_checkpoint"] = ckpt.enable_first_step_checkpoint
        for option, used in saves.items():
            if used:
                raise ConfigError(f"checkpoint.{option}: it saves, which checkpoint.load_only rules out")
    if config.training.nonfinite_policy == "rollback" and not ckpt.enable:
        raise ConfigError("training.nonfinite_policy: 'rollback' needs checkpoint.enable")
    if ckpt.create_seed_checkpoint and config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("checkpoint.create_seed_checkpoint: run it on 1 rank without pipeline parallelism")


def help_text(program: str = "train.py") -> str:
    """Every option with its type, default and documentation."""
    lines = [
        f"usage: {program} [--job.config_file FILE.toml] [--section.field VALUE ...]",
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


# TOML basic strings take no control character (tab aside) nor DEL: all are escaped, as are \\ and ".
_TOML_ESCAPES = {code: f"\\u{code:04X}" for code in (*range(0x20), 0x7F)} | {
    ord("\\"): "\\\\",
    ord('"'): '\\"',
    ord("\n"): "\\n",
    ord("\t"): "\\t",
    ord("\r"): "\\r",
}


def _toml_value(value: typing.Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.translate(_TOML_ESCAPES) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (unset optional values are left out)."""
    lines = []
    for section_name, values in config.to_dict().items():
        lines.append(f"[{section_name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None)
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
