"""What a run records about itself to be run or exported again: its resolved config as plain data
(config.json in the run directory, `run_config` in a checkpoint's meta.json) and the reference to its
recipe (`recipe` in meta.json). Reading config files back (`--config`) is the CLI's
(`fntrain.cli.config_file`); this module only writes.

The files a run reads are recorded by where they are, not by how they were spelled: each field a config
section lists in its `PATH_FIELDS` (`data.path`, `model.path`, ...) is recorded absolute when it names
a file or directory (`recorded_config`), so `fntrain eval`, `generate`, `export` and a resume read the
record back from any directory; the config itself keeps the user's spelling for messages and logs, and
a resume compares such fields as files (`same_file`), not as strings.

TOML has no null: `dump_toml` comments out a None whose default is None and spells any other None
"None", and says so at the top of the file; `fntrain.cli.config_file` reads both back to the same config.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "NONE_STRING", "FILE_MODULE_PREFIX", "config_to_dict", "dump_toml", "class_defaults", "write_config",
    "recipe_reference", "path_fields", "recorded_config", "same_file",
]  # fmt: skip

NONE_STRING = "None"  # how an absent value is spelled where a format has no null (TOML; tyro's CLI too)
# The made-up module name a recipe imported from a .py file gets (`fntrain.cli.recipes`), so that its
# reference can be the file's path instead.
FILE_MODULE_PREFIX = "fntrain_recipe_file_"


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data (tuples become lists, paths strings, enums their values)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [plain(v) for v in value]
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return value

    return plain(config)


def path_fields(config: Any, prefix: str = "") -> list[str]:
    """The dotted names of the fields of `config` (and its sections, recursively) that name files or
    directories the run reads, relative to the working directory: each section's `PATH_FIELDS`."""
    names = [f"{prefix}{name}" for name in getattr(type(config), "PATH_FIELDS", ())]
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names.extend(path_fields(value, f"{prefix}{item.name}."))
    return names


def recorded_config(config: Any) -> dict[str, Any]:
    """The config as a run records it: `config_to_dict`, with each of its `path_fields` that names an
    existing file or directory made absolute (`~` expanded), so the record reads back from any
    directory; a value that names nothing here (unset, a Jinja template's text) is kept as written."""
    data = config_to_dict(config)
    for name in path_fields(config):
        *sections, leaf = name.split(".")
        holder = data
        for section in sections:
            holder = holder.get(section) if isinstance(holder, dict) else None
        value = holder.get(leaf) if isinstance(holder, dict) else None
        if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
            holder[leaf] = os.path.abspath(os.path.expanduser(value))
    return data


def same_file(recorded: Any, given: Any) -> bool:
    """Whether two spellings of a path field name the same file or directory (a relative one read from
    the working directory): the same absolute path, or one file reached two ways (a link)."""
    if not (isinstance(recorded, str) and isinstance(given, str) and recorded and given):
        return False
    first, second = os.path.expanduser(recorded), os.path.expanduser(given)
    if os.path.abspath(first) == os.path.abspath(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # either is gone: nothing says they are one
        return False


_MISSING = object()
NULL_NOTE = (
    "# TOML has no null: a field that is None (its default) is written commented out, `# key = None`,\n"
    "# and an absent key keeps its default; a None over another default is the string \"None\"."
)


def dump_toml(data: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """A nested dict of scalars and lists as TOML. TOML has no null: with `defaults` (the config class's
    own values, `config_to_dict(type(config)())`), a None whose default is None too is written
    commented out (reading the file leaves it at that default); any other None is the string "None",
    which `config_from_dict` reads back as None for an optional field. Either way the file reads back
    to the same config, and a note at its top says so."""
    lines: list[str] = []

    def scalar(value: Any) -> str:
        if value is None:
            return json.dumps(NONE_STRING)
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int):
            return str(value)
        if isinstance(value, float):
            if math.isnan(value):
                return "nan"
            if math.isinf(value):
                return "inf" if value > 0 else "-inf"
            return repr(value)
        if isinstance(value, str):
            return json.dumps(value, ensure_ascii=False)  # JSON string escapes are valid TOML basic strings
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        if isinstance(value, Mapping):
            return "{" + ", ".join(f"{_toml_key(k)} = {scalar(v)}" for k, v in value.items()) + "}"
        raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")

    def line(key: str, value: Any, default: Any) -> str:
        if value is None and default is None:
            return f"# {_toml_key(key)} = None"
        return f"{_toml_key(key)} = {scalar(value)}"

    def table(name: str, values: Mapping[str, Any], known: Any) -> None:
        known = known if isinstance(known, Mapping) else {}
        plain = {k: v for k, v in values.items() if not (isinstance(v, Mapping) and v and _is_table(v))}
        nested = {k: v for k, v in values.items() if k not in plain}
        if name and (plain or not nested):
            lines.append(f"\n[{name}]")
        for key, value in plain.items():
            lines.append(line(key, value, known.get(key, _MISSING)))
        for key, value in nested.items():
            table(f"{name}.{_toml_key(key)}" if name else _toml_key(key), value, known.get(key))

    table("", data, defaults)
    text = "\n".join(lines).lstrip("\n") + "\n"
    return f"{NULL_NOTE}\n{text}" if any(v is None for v in _leaves(data)) else text


def _leaves(data: Any) -> list[Any]:
    if isinstance(data, Mapping):
        return [leaf for value in data.values() for leaf in _leaves(value)]
    return [data]


def _is_table(value: Mapping[str, Any]) -> bool:
    return all(isinstance(k, str) for k in value)


def _toml_key(key: Any) -> str:
    key = str(key)
    return key if key and all(c.isalnum() or c in "_-" for c in key) else json.dumps(key)


def class_defaults(config: Any) -> dict[str, Any] | None:
    """The config class's own values (what a file's absent key keeps), or None when it has required fields."""
    try:
        return config_to_dict(type(config)())
    except TypeError:
        return None


def write_config(
    config: Any, run_dir: str | os.PathLike[str], *, formats: Sequence[str] = ("json",)
) -> list[Path]:
    """Write the resolved config into `run_dir` as config.json (and/or config.toml), as the run records
    it (`recorded_config`: its files by absolute path); every file it writes reads back with
    `fntrain.cli.config_file.load_config` to an equal config, the same files named absolutely."""
    run_dir = Path(run_dir).expanduser()
    run_dir.mkdir(parents=True, exist_ok=True)
    data = recorded_config(config)
    written = []
    for fmt in formats:
        if fmt == "json":
            text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        elif fmt == "toml":
            text = dump_toml(data, class_defaults(config))
        else:
            raise ValueError(f"unknown config format {fmt!r}; use json or toml")
        path = run_dir / f"config.{fmt}"
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        written.append(path)
    return written


def recipe_reference(config_class: type) -> str:
    """What `fntrain.cli.recipes.load_recipe` takes to load the recipe whose config class is
    `config_class` again: its module's dotted name, or the path of the .py file it was imported from
    (whose module name was made up on import)."""
    name = config_class.__module__
    module = sys.modules.get(name)
    if name.startswith(FILE_MODULE_PREFIX) or name == "__main__":
        return str(Path(getattr(module, "__file__", None) or name).resolve())
    return name
