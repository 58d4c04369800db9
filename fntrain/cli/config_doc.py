"""The config reference page (docs/config.md): every flag of the built-in recipes, its type, default and
meaning, from the config dataclasses and their field docstrings (the text `--help-all` shows).

    python -m fntrain.cli.config_doc > docs/config.md     # tests/cli/test_config_doc.py checks it is current

The shared `JobConfig` sections come first with their defaults; then, per recipe, the defaults it
changes and the sections only it has. Field docstrings are read with `ast` from the class source, the
way tyro finds them, since dataclasses keep no docstrings of their own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

from fntrain.cli.recipes import load_recipe
from fntrain.config import flag_name
from fntrain.run.config import JobConfig

__all__ = ["config_reference", "field_docstrings"]

RECIPES = ("tiny_gpt", "hf_causal_lm", "vlm", "dpo", "kd", "grpo")


@cache
def _own_docstrings(cls: type) -> dict[str, str]:
    """The docstrings written under the fields `cls` itself declares."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a class made at run time): no docstrings
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):  # fmt: skip
            found[node.target.id] = " ".join(after.value.value.split())
    return found


def field_docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring, the nearest class in the MRO that documents it winning."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        docs.update(_own_docstrings(base))
    return docs


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args).replace("NoneType", "None")
    if origin is not None:
        inner = ", ".join("..." if arg is Ellipsis else _type_name(arg) for arg in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(hint, "__name__", str(hint))


def _default(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "`" + (" ".join(map(str, value)) if value else "(empty)") + "`"
    return f"`{value}`" if value != "" else '`""`'


def _rows(cls: type, instance: Any, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    """(flag, type, default, meaning) of every leaf field of the dataclass `cls` under `prefix`."""
    hints, docs = typing.get_type_hints(cls), field_docstrings(cls)
    for item in dataclasses.fields(cls):
        hint, value, name = hints[item.name], getattr(instance, item.name), f"{prefix}{item.name}"
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _rows(hint, value, f"{name}.")
        else:
            yield flag_name(name), _type_name(hint), _default(value), docs.get(item.name, "")


def _sections(cls: type) -> dict[str, type | None]:
    """Top-level field name -> its dataclass (None for a plain field), in declaration order."""
    hints = typing.get_type_hints(cls)
    return {item.name: hints[item.name] if dataclasses.is_dataclass(hints[item.name]) else None
            for item in dataclasses.fields(cls)}  # fmt: skip


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    lines += [
        f"| `{flag}` | {kind} | {default} | {_cell(meaning)} |" for flag, kind, default, meaning in rows
    ]
    return "\n".join(lines)


def config_reference(recipes: tuple[str, ...] = RECIPES) -> str:
    """The whole page as Markdown."""
    shared = _sections(JobConfig)
    docs = field_docstrings(JobConfig)
    base = JobConfig()
    out = ["# Config reference", "",
           "Every flag of the built-in recipes, generated from the config dataclasses and their docstrings "
           "(`python -m fntrain.cli.config_doc > docs/config.md`; `fntrain run RECIPE --help-all` prints the same "
           "text). In a config file (`--config FILE.toml`) a flag is a key of its section: "
           "`--train.global-batch-size 64` is `global_batch_size = 64` under `[train]`; `fntrain config RECIPE` "
           "writes a recipe's whole config as a file to start from.", "",
           "## Shared by every recipe (`JobConfig`)", "",
           _table([row for name, section in shared.items() if section is None
                   for row in _rows(JobConfig, base, "") if row[0] == flag_name(name)])]  # fmt: skip
    for name, section in shared.items():
        if section is not None:
            rows = list(_rows(section, getattr(base, name), f"{name}."))
            out += ["", f"### `{name}`", "", docs.get(name, ""), "", _table(rows)]
    for recipe_name in recipes:
        config_cls = load_recipe(recipe_name).spec.config
        recipe_default, doc = config_cls(), (config_cls.__doc__ or "").strip()
        own = {name: section for name, section in _sections(config_cls).items() if name not in shared}
        changed = [row for row, old in zip(_rows(config_cls, recipe_default, ""), _shared_rows(config_cls, base), strict=True)
                   if old is not None and row[2] != old[2]]  # fmt: skip
        out += ["", f"## `{recipe_name}`", "", doc]
        if changed:
            out += ["", "Defaults it changes:", "", _table(changed)]
        own_flags = {flag_name(name) for name, section in own.items() if section is None}
        plain = [row for row in _rows(config_cls, recipe_default, "") if row[0] in own_flags]
        if plain:
            out += ["", "Its own settings:", "", _table(plain)]
        for name, section in own.items():
            if section is not None:
                docs_here = field_docstrings(config_cls)
                out += ["", f"### `{recipe_name}`: `{name}`", "", docs_here.get(name, ""), "",
                        _table(list(_rows(section, getattr(recipe_default, name), f"{name}.")))]  # fmt: skip
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)) + "\n"


def _shared_rows(config_cls: type, base: JobConfig) -> Iterator[tuple[str, str, str, str] | None]:
    """For each leaf row of `config_cls`, the shared JobConfig's row of the same flag (None if it has none)."""
    shared = {row[0]: row for row in _rows(JobConfig, base, "")}
    for row in _rows(config_cls, config_cls(), ""):
        yield shared.get(row[0])


if __name__ == "__main__":
    print(config_reference(), end="")
