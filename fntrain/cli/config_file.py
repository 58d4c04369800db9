"""Config files: seed a recipe's frozen config from TOML, YAML or JSON, then let CLI flags override it.

    fntrain run tiny_gpt --config base.toml --train.train-iters 50
    python -m recipes.tiny_gpt --config runs/tiny_gpt/config.json     # a run's resolved config, fed back

A file is a (nested) table whose keys are the config's field names (`train_iters` or `train-iters`);
a key the config does not have, or a value of the wrong type, is an error naming the dotted field
(`train.train_iters must be an int, got '5' (str)`) before any model or device work. Fields a file
leaves out keep the config's defaults. TOML has no null: leave out (or comment out) a field to keep
its default, or write the string "None" for an optional field; the TOML `fntrain.run.resolved` writes
(`fntrain config`, a run's config.toml) comments out a None whose default is None and spells any
other None "None", and says so at its top. Formats by suffix: `.toml` (standard library `tomllib`, or
`tomli` before Python 3.11), `.yaml`/`.yml` (PyYAML, the `yaml` extra), `.json`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fntrain.config import ConfigError, first_line
from fntrain.run.resolved import NONE_STRING

__all__ = [
    "ConfigFileError",
    "read_config_file",
    "config_from_dict",
    "load_config",
    "split_config_args",
    "parse_config_cli",
]

T = TypeVar("T")
SUFFIXES = (".toml", ".yaml", ".yml", ".json")


class ConfigFileError(ConfigError):
    """A config file that cannot be read or parsed (missing, a directory, unknown suffix, not text, a
    syntax error): one line starting with `--config` and the file as typed."""


# ----------------------------------------------------------------------------- reading


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's top-level table as a dict; the format comes from the suffix. Every problem is a
    `ConfigFileError` of one line, `--config 'bad.yaml' line 3: ...`, naming the file as given."""
    where = f"--config {str(path)!r}"
    file = Path(path).expanduser()
    if file.is_dir():
        raise ConfigFileError(f"{where} is a directory, not a config file")
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigFileError(f"{where}: unknown format {suffix!r}; use one of {', '.join(SUFFIXES)}")
    if not file.is_file():
        raise ConfigFileError(f"{where} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigFileError(f"{where} is not UTF-8 text (a binary file?)") from None
    except OSError as error:  # unreadable: permissions, a special file
        raise ConfigFileError(f"{where} cannot be read ({error.strerror or error})") from None
    data = _parse(text, suffix, where)
    if data is None:  # an empty YAML file
        return {}
    if not isinstance(data, Mapping):
        raise ConfigFileError(f"{where} must hold a table of fields, got {type(data).__name__}")
    return dict(data)


def _parse(text: str, suffix: str, where: str) -> Any:
    """`text` parsed as `suffix` says; a syntax error is one line naming the line (each parser has its
    own error class and layout: PyYAML's spans eight lines)."""
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigFileError(
                f"{where} line {error.lineno}: {error.msg} (column {error.colno})"
            ) from None
    if suffix == ".toml":
        toml = _toml_module()
        try:
            return toml.loads(text)
        except toml.TOMLDecodeError as error:
            message = str(error)
            at = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
            if at is None:
                raise ConfigFileError(f"{where}: {message}") from None
            line, column = at.groups()
            raise ConfigFileError(f"{where} line {line}: {message[: at.start()]} (column {column})") from None
    yaml = _yaml_module()
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark, opened = error.problem_mark, error.context_mark
        place = f" line {mark.line + 1}" if mark is not None else ""
        context = (
            f"{error.context}{f' from line {opened.line + 1}' if opened else ''}: " if error.context else ""
        )
        column = f" (column {mark.column + 1})" if mark is not None else ""
        raise ConfigFileError(f"{where}{place}: {context}{error.problem}{column}") from None
    except yaml.YAMLError as error:
        raise ConfigFileError(f"{where}: {first_line(error)}") from None


def _toml_module() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib  # the standard library's TOML reader from 3.11

        return tomllib
    try:
        import tomli  # optional: TOML before 3.11
    except ImportError as error:
        raise ConfigFileError(
            "reading TOML on Python < 3.11 needs the tomli package (pip install tomli)"
        ) from error
    return tomli


def _yaml_module() -> Any:
    try:
        import yaml  # optional (extra `yaml`)
    except ImportError as error:
        raise ConfigFileError("reading YAML needs PyYAML: pip install 'fntrain[yaml]'") from error
    return yaml


# ----------------------------------------------------------------------------- typed conversion


def config_from_dict(cls: type[T], data: Mapping[str, Any], *, base: T | None = None, prefix: str = "") -> T:
    """An instance of the dataclass `cls`: `base` (default: `cls()`) with the fields `data` sets.

    Nested dataclass fields take nested tables (merged into the base's value field by field). Unknown
    keys raise `ValueError`, values of the wrong type `TypeError`; both name the dotted field.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    base = cls() if base is None else base
    return _merge_dataclass(cls, base, data, prefix)


def _merge_dataclass(cls: type, base: Any, data: Any, prefix: str) -> Any:
    where = prefix or "the config"
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a table of fields, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls, include_extras=False)
    changes: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown config key {dotted!r}{hint} (known at {where}: {', '.join(sorted(fields))})"
            )
        if key in changes:
            raise ValueError(f"config key {dotted!r} is given twice")
        current = getattr(base, key) if base is not None else None
        changes[key] = _convert(hints[key], value, dotted, current)
    return dataclasses.replace(base, **changes) if changes else base


def _convert(hint: Any, value: Any, field: str, current: Any = None) -> Any:
    """`value` checked against the annotation `hint`, converted where the file format is looser
    (a list for a tuple, an int for a float, "None" for None)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if origin is typing.Annotated:
        return _convert(args[0], value, field, current)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return _convert_union(hint, args, value, field, current)
    if hint is type(None):
        if value is None or value == NONE_STRING:
            return None
        raise TypeError(f"{field} must be None, got {_show(value)}")
    if origin is typing.Literal:
        for choice in args:
            if value == choice and type(value) is type(choice):
                return choice
        raise ValueError(f"{field} must be one of {list(args)!r}, got {_show(value)}")
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        base = current if isinstance(current, hint) else hint()
        return _merge_dataclass(hint, base, value, field)
    if hint is bool:
        if type(value) is not bool:
            raise TypeError(f"{field} must be a bool (true/false), got {_show(value)}")
        return value
    if hint is int:
        if type(value) is not int:
            raise TypeError(f"{field} must be an int, got {_show(value)}")
        return value
    if hint is float:
        if type(value) not in (int, float):
            raise TypeError(f"{field} must be a number, got {_show(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{field} must be a string, got {_show(value)}")
        return value
    if isinstance(hint, type) and issubclass(hint, os.PathLike):
        if not isinstance(value, str):
            raise TypeError(f"{field} must be a path string, got {_show(value)}")
        return hint(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if value == member.name or value == member.value:
                return member
        raise ValueError(f"{field} must be one of {[m.name for m in hint]!r}, got {_show(value)}")
    if origin in (tuple, list, set, frozenset) or hint in (tuple, list, set, frozenset):
        return _convert_sequence(origin or hint, args, value, field)
    if origin in (dict, Mapping) or hint is dict or origin is typing.get_origin(Mapping[str, Any]):
        if not isinstance(value, Mapping):
            raise TypeError(f"{field} must be a table, got {_show(value)}")
        key_hint, value_hint = args if len(args) == 2 else (Any, Any)
        return {
            _convert(key_hint, k, f"{field} key", None): _convert(value_hint, v, f"{field}.{k}", None)
            for k, v in value.items()
        }
    raise TypeError(f"{field}: config files cannot set a field of type {hint!r}")


def _convert_union(hint: Any, args: tuple[Any, ...], value: Any, field: str, current: Any) -> Any:
    if type(None) in args and (value is None or value == NONE_STRING):
        return None
    errors = []
    # A bool must not slip into an int arm, nor an int into a str arm: try exact types first.
    for arm in sorted((a for a in args if a is not type(None)), key=lambda a: a is not type(value)):
        try:
            return _convert(arm, value, field, current)
        except (TypeError, ValueError) as error:
            errors.append(error)
    if len(errors) == 1:
        raise errors[0]
    raise TypeError(f"{field} must be {_type_name(hint)}, got {_show(value)}")


def _convert_sequence(kind: Any, args: tuple[Any, ...], value: Any, field: str) -> Any:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{field} must be a list, got {_show(value)}")
    if kind is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ValueError(f"{field} must have {len(args)} items, got {len(value)}: {list(value)!r}")
        return tuple(
            _convert(arm, item, f"{field}[{i}]")
            for i, (arm, item) in enumerate(zip(args, value, strict=True))
        )
    item_hint = args[0] if args else Any
    items = [_convert(item_hint, item, f"{field}[{i}]") for i, item in enumerate(value)]
    return kind(items) if kind is not list else items


def _type_name(hint: Any) -> str:
    text = getattr(hint, "__name__", None) or str(hint)
    return text.replace("typing.", "")


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def load_config(cls: type[T], *paths: str | os.PathLike[str], base: T | None = None) -> T:
    """`cls` seeded from the files in order (later files override earlier ones); errors name the file."""
    config = cls() if base is None else base
    for path in paths:
        data = read_config_file(path)
        try:
            config = config_from_dict(cls, data, base=config)
        except (TypeError, ValueError) as error:
            raise type(error)(f"--config {str(path)!r}: {error}") from error
    return config


# ----------------------------------------------------------------------------- the command line


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(config file paths, remaining args): every `--config FILE` / `--config=FILE` is taken out."""
    paths: list[str] = []
    rest: list[str] = []
    args = list(argv)
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--config":
            if index + 1 >= len(args) or args[index + 1].startswith("--"):
                raise ConfigFileError("--config needs a file path")
            paths.append(args[index + 1])
            index += 2
            continue
        if arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        index += 1
    return paths, rest


CONFIG_HELP = (
    "Defaults can be seeded from a config file: --config FILE (.toml, .yaml/.yml or .json, e.g. a run's "
    "config.json); flags given after it override the file."
)


def parse_config_cli(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    prog: str | None = None,
) -> T:
    """tyro's CLI for `cls`, with defaults seeded by any `--config FILE` in `argv` (None: sys.argv); a
    rejected flag raises `fntrain.cli.errors.CommandError` with its one line (`fntrain.cli.parse`)."""
    from fntrain.cli.parse import parse  # import time: reading a config file needs no CLI parser

    argv = sys.argv[1:] if argv is None else list(argv)
    paths, rest = split_config_args(argv)
    default = load_config(cls, *paths)
    text = f"{description.strip()}\n\n{CONFIG_HELP}" if description else CONFIG_HELP
    return parse(cls, rest, default=default, description=text, prog=prog or os.path.basename(sys.argv[0]))
