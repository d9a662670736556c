"""Loading the job config (defaults < TOML file < command line) and validating it; ``--help``; the TOML dump."""

from __future__ import annotations

import ast
import collections
import dataclasses
import difflib
import inspect
import json
import logging
import os
import re
import sys
import textwrap
import types
import typing

from config import rules, torchtitan
from config.errors import ConfigError
from config.job_config import JobConfig, written_by_a_run

logger = logging.getLogger(__name__)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def _sections() -> dict[str, type]:
    return typing.get_type_hints(JobConfig)  # section name -> its dataclass, in order


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass (its only expression statements)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(tp: typing.Any) -> str:
    inner, optional = _unwrap_optional(tp)
    name = _type_name(_list_item(inner)) + " list" if _list_item(inner) else inner.__name__
    name = "str" if _choices(inner) else name
    return name + " (optional)" if optional else name


def _unwrap_optional(tp: typing.Any) -> tuple[typing.Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def _list_item(tp: typing.Any) -> typing.Any:
    """The type of a list's items; None for any other type."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _choices(tp: typing.Any) -> tuple[str, ...]:
    """The values a ``Literal[...]`` field accepts; empty for any other type."""
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, value: typing.Any, tp: typing.Any, from_cli: bool) -> typing.Any:
    """A CLI string (or a TOML value, already of the right type) as the field's type, or ConfigError."""
    inner, optional = _unwrap_optional(tp)
    choices = _choices(inner)
    item_type = _list_item(inner)
    if not from_cli and isinstance(value, str) and inner is not str and not choices and not item_type:
        raise ConfigError(f"{key}: expected {_type_name(inner)}, got the string {value!r}")
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("", "none"))):
        return None
    if item_type:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
            if _list_item(item_type):  # a list of lists on the command line: 'a+b,c'
                value = [[w.strip() for w in v.split("+")] for v in value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {_type_name(item_type)}, got {value!r}")
        if _list_item(item_type) and not all(isinstance(v, list) for v in value):
            # A flat TOML list would be read as one list per name (for stages: a stage per module).
            raise ConfigError(f"{key}: expected a list of lists ([[...], [...]]), got {value!r}")
        return [_convert(key, v, item_type, from_cli) for v in value]
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if inner in (int, float):
        expected = f"{key}: expected {'an integer' if inner is int else 'a number'}, got {value!r}"
        if isinstance(value, bool) or (inner is int and isinstance(value, float)):
            raise ConfigError(expected)
        try:
            return inner(value)
        except (TypeError, ValueError):
            raise ConfigError(expected) from None
    if choices and value not in choices:
        raise ConfigError(f"{key}: '{value}' is not one of {', '.join(choices)}{_suggest(str(value), choices)}")
    if not isinstance(value, str):  # the schema's other fields are strings
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    # A home-relative path reaches us unexpanded from TOML and from --option=~/x.
    return os.path.expanduser(value) if value.startswith("~") else value


def _suggest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in _sections().items() for f in dataclasses.fields(cls)]


def _field_type(key: str) -> typing.Any:
    section_name, _, field_name = key.partition(".")
    cls = _sections().get(section_name)
    return typing.get_type_hints(cls).get(field_name) if cls else None


def _parse_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """``--a.b v``, ``--a.b=v`` and bare ``--flag`` as (key, value or None) pairs; dashes read as underscores."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        if not eq:  # the value is the next argument, unless that is an option too
            value = argv[i] if i < len(argv) and not argv[i].startswith("--") else None
            i += value is not None
        pairs.append((key.replace("-", "_"), value))
    return pairs


def _flatten(table: dict, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, value) of every leaf of a TOML table: [quantize.linear.float8] nests three deep."""
    leaves = []
    for name, value in table.items():
        leaves += _flatten(value, f"{prefix}{name}.") if isinstance(value, dict) else [(f"{prefix}{name}", value)]
    return leaves


def _read_toml(path: str) -> list[tuple[str, typing.Any]]:
    if not os.path.isfile(path):  # a folder, /dev/null or a pipe (read once, or empty), or nothing
        what = (
            "is a folder" if os.path.isdir(path) else "is not a regular file" if os.path.exists(path) else "not found"
        )
        raise ConfigError(f"config file {what}: {path} (--job.config_file)")
    try:
        with open(path, "rb") as f:
            # utf-8-sig: editors on Windows begin files with a byte-order mark, which TOML does not allow.
            return _flatten(tomllib.loads(f.read().decode("utf-8-sig")))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it: {e}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _config_file(pairs: list[tuple[str, str | None]]) -> str | None:
    """The TOML file the command line's options name (the last --job.config_file given), if any."""
    return next((v for k, v in reversed(pairs) if k == "job.config_file"), None)


def load_config(argv: list[str]) -> JobConfig:
    """The job config from defaults, the TOML file of the last --job.config_file, then the command line, torchtitan's
    names included. A ConfigError for any bad input names every unknown option."""
    pairs = [_negated_flag(key, value) for key, value in _parse_cli(argv)]
    given = collections.Counter(key for key, _ in pairs)
    if repeated := [f"--{key} ({n} times)" for key, n in given.items() if n > 1]:
        logger.warning("given more than once, the last counts: %s", ", ".join(repeated))
    for key, value in pairs:
        field_type = _field_type(torchtitan.ALIASES.get(key, key))
        if value is None and field_type is not None and _unwrap_optional(field_type)[0] is not bool:
            raise ConfigError(f"--{key} needs a value")
    config_file = _config_file(pairs)
    if config_file is not None and not config_file.strip():
        raise ConfigError("job.config_file: no file given (leave the option out for the defaults alone)")
    file_settings = _read_toml(config_file) if config_file else []
    # A run's resolved config names the file it was made from; any other file thinks it reads one.
    if (nested := dict(file_settings).get("job.config_file")) and not written_by_a_run(config_file):
        logger.warning(
            "job.config_file = %r in %s has no effect: a config file does not read another "
            "(the command line's --job.config_file names the one file read)",
            nested,
            config_file,
        )
    config, unknown, foreign = JobConfig(), [], {}
    if config_file:
        _apply_source(config, file_settings, f" in {config_file}", unknown, foreign)
        config.job.config_file = config_file
    last = {k: True if v is None else v for k, v in pairs if k != "job.config_file"}  # the last counts
    _apply_source(config, list(last.items()), "", unknown, foreign)
    if unknown:
        raise ConfigError("; ".join(dict.fromkeys(unknown)))
    _check_foreign(foreign)
    rules.validate(config)
    rules.warn_no_effect(config, typed_options(argv))
    return config


def named_as_given(error: ConfigError, argv: list[str]) -> ConfigError:
    """``error`` with each option the user set by a torchtitan name (in ``argv`` or its config file) called by it."""
    try:
        pairs = _parse_cli(argv)
        config_file = _config_file(pairs)
        file_keys = [key for key, _ in _read_toml(config_file)] if config_file else []
    except ConfigError:  # unreadable: the error says so, naming no option
        return error
    aliases, names = torchtitan.ALIASES, {}
    for keys in (file_keys, [key for key, _ in pairs]):  # the command line's value, and name, win
        for option in {aliases.get(key, key) for key in keys}:
            names.pop(option, None)
        # An option given by both names in one source (a contradiction's line names both) keeps its name.
        names.update({aliases[key]: key for key in keys if key in aliases and aliases[key] not in keys})
    if not names:
        return error
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?![\w.])")
    return ConfigError(pattern.sub(lambda match: names[match.group(1)], str(error)))


def typed_options(argv: list[str]) -> set[str]:
    """The options named on the command line ``argv``, by Tessera's names."""
    pairs = [_negated_flag(key, value) for key, value in _parse_cli(argv)]
    return {torchtitan.ALIASES.get(key, key) for key, _ in pairs}


def _negated_flag(key: str, value: str | None) -> tuple[str, str | None]:
    """torchtitan's bare ``--section.no_flag`` as ``--section.flag false``."""
    section, _, name = key.rpartition(".")
    flag = f"{section}.{name[3:]}"
    known = _field_type(flag) is not None or any(
        flag in names for names in (torchtitan.ALIASES, torchtitan.NEGATED, torchtitan.FOREIGN)
    )
    return (flag, "false") if value is None and name.startswith("no_") and known else (key, value)


def _apply_source(config: JobConfig, settings: list, origin: str, unknown: list, foreign: dict) -> None:
    """Applies one file's or the command line's settings; one option given twice with two values is refused."""
    seen: dict[str, tuple[str, typing.Any]] = {}  # Tessera option: (name given, value it set)
    # torchtitan's renamed options after the direct ones: dataset_path wins over dataset.
    for key, value in sorted(settings, key=lambda kv: kv[0] in torchtitan.ALIASES):
        applied = _apply(config, key, value, origin, unknown, foreign)
        if applied is None or key in torchtitan.OVERRIDING:
            continue
        target, now = applied
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
    why = "one option by Tessera's and torchtitan's names; give one"
    why = "the same option twice; give it once" if first == second else why
    return f"{shown[0]} and {shown[1]}{origin} contradict each other: {why}"


def _apply(config: JobConfig, key: str, value: typing.Any, origin: str, unknown: list, foreign: dict) -> tuple | None:
    """Sets one setting by either name and returns (Tessera's option, its value); records what is unknown or foreign."""
    if key in torchtitan.NEGATED:
        key, value = torchtitan.NEGATED[key], _convert(key, value, bool, not origin) is False
    key = torchtitan.ALIASES.get(key, key)
    if (field_type := _field_type(key)) is not None:
        try:
            value = _convert(key, _renamed_values(key, value), field_type, from_cli=not origin)
        except ConfigError as e:
            raise ConfigError(f"{e}{origin}") from None
        section_name, _, field_name = key.partition(".")
        setattr(getattr(config, section_name), field_name, value)
        return key, value
    if key in torchtitan.FOREIGN:
        foreign[key] = value
    else:
        unknown.append(_unknown(key, origin))
    return None


def _renamed_values(key: str, value: typing.Any) -> typing.Any:
    """``value`` with torchtitan's names of ``key``'s values as Tessera's (a command line's list: comma-separated)."""
    names = torchtitan.VALUE_ALIASES.get(key, {})
    if names and isinstance(value, str):
        return ",".join(names.get(item.strip(), item) for item in value.split(","))
    if names and isinstance(value, list):
        return [names.get(item, item) if isinstance(item, str) else item for item in value]
    return value


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
    """torchtitan options of features Tessera lacks: an error when the run cannot go without the feature, else one
    warning line; one more for those left at no effect."""
    foreign = {key: _as_neutral_type(key, value) for key, value in foreign.items()}
    wanted = {key: value for key, value in foreign.items() if torchtitan.FOREIGN[key] not in (torchtitan.ANY, value)}
    missing = ", ".join(f"{key}={value!r}" for key, value in wanted.items())
    if blocking := wanted.keys() & torchtitan.CHANGES_THE_RUN.keys():
        instead = "".join(dict.fromkeys(torchtitan.CHANGES_THE_RUN[key] for key in sorted(blocking)))
        raise ConfigError(f"not available in Tessera: {missing}{instead}")
    if wanted:
        logger.warning("not available in Tessera, training without them: %s", missing)
    if ignored := sorted(foreign.keys() - wanted.keys()):
        logger.warning("torchtitan options with no effect in Tessera, ignored: %s", ", ".join(ignored))


def _as_neutral_type(key: str, value: typing.Any) -> typing.Any:
    """A command line's string for a foreign option as its neutral value's type, so that 'false' leaves it off too."""
    neutral = torchtitan.FOREIGN[key]
    if not isinstance(value, str) or neutral is torchtitan.ANY or isinstance(neutral, str):
        return value
    try:
        return _convert(key, value, type(neutral), from_cli=True)
    except ConfigError:
        return value  # not of the type: named as given, asking for the feature


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
            default = getattr(getattr(defaults, section_name), f.name)
            lines.append(f"  --{section_name}.{f.name} {_type_name(hints[f.name])} (default: {default!r})")
            if choices := _choices(hints[f.name]):
                docs[f.name] += f" Choices: {', '.join(choices)}."
            lines.extend("      " + line for line in textwrap.wrap(docs[f.name], 90))
    return "\n".join(lines)


def _toml_value(value: typing.Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # JSON's strings, numbers, booleans and arrays are TOML's


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (unset optional values are left out)."""
    lines = []
    for section_name, values in dataclasses.asdict(config).items():
        lines.append(f"[{section_name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None)
        lines.append("")
    return "\n".join(lines)
