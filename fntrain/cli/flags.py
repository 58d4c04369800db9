"""The flags a command's tyro parser takes, read from the same dataclasses or function signature tyro
reads, with their types, defaults and docstrings: what a parse error's "did you mean" and expected
type, and the short `--help`, are made of.

tyro's own flag list is internal to its parser; this walk follows the naming rules fntrain's commands
use (a nested dataclass is a dotted section, `tyro.conf.arg(name="")` flattens one, a positional
argument is no flag, `tyro.conf.Suppress` hides one). A flag it misses only costs a suggestion.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import os
import types
import typing
from collections.abc import Iterator
from typing import Any

__all__ = ["Flag", "command_flags", "type_words", "metavar"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: `--train.train-iters`, its annotation, its default, its docstring, and its section
    (`train`; "" at the top) with the section's docstring."""

    name: str
    hint: Any
    default: Any
    doc: str
    section: str = ""
    section_doc: str = ""


def command_flags(f: Any, default: Any = None) -> dict[str, Flag]:
    """Every flag of `f` (a dataclass or a function), by name, in declaration order; `default` (an
    instance of the dataclass `f`) supplies the defaults shown."""
    return {flag.name: flag for flag in _walk(f, default, prefix="", section=("", ""))}


def _walk(f: Any, instance: Any, prefix: str, section: tuple[str, str]) -> Iterator[Flag]:
    for name, hint, value, doc in _members(f, instance):
        stripped, meta = _strip(hint)
        if any(_is_marker(item, "Suppress") or _is_marker(item, "Positional") for item in meta):
            continue
        configs = [item for item in meta if _is_arg_config(item)]  # tyro.conf.arg(name=..., help=...)
        renamed = next((item.name for item in configs if item.name is not None), None)
        doc = next((item.help for item in configs if item.help), doc)
        own = name if renamed is None else renamed
        if dataclasses.is_dataclass(stripped) and isinstance(stripped, type):
            dotted = f"{prefix}{own}." if own else prefix
            inner = (dotted.rstrip("."), doc or _class_doc(stripped)) if own else section
            yield from _walk(stripped, value, dotted, inner)
        else:
            yield Flag("--" + f"{prefix}{own}".replace("_", "-"), stripped, value, doc, *section)


def _members(f: Any, instance: Any) -> Iterator[tuple[str, Any, Any, str]]:
    """(name, annotation with its markers, default, docstring) of each field or parameter of `f`."""
    from fntrain.cli.config_doc import field_docstrings

    target = f if isinstance(f, type) else getattr(f, "__wrapped__", f)
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # an annotation that does not resolve here: no flags from it, only no suggestion
        return
    if dataclasses.is_dataclass(f) and isinstance(f, type):
        docs = field_docstrings(f)
        for item in dataclasses.fields(f):
            if item.init:
                yield (
                    item.name,
                    hints.get(item.name, Any),
                    _field_default(item, instance),
                    docs.get(item.name, ""),
                )
        return
    for name, parameter in inspect.signature(f).parameters.items():
        if name in hints:
            value = None if parameter.default is inspect.Parameter.empty else parameter.default
            yield name, hints[name], value, ""


def _class_doc(cls: type) -> str:
    """A section's own docstring (what tyro shows under a section without a field docstring); not the
    signature `dataclasses` writes for an undocumented class."""
    doc = " ".join((cls.__doc__ or "").split())
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def _field_default(item: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, item.name, None)
    if item.default is not dataclasses.MISSING:
        return item.default
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return None


def _strip(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the annotation without `Annotated`, the markers it carried)."""
    meta: tuple[Any, ...] = ()
    while typing.get_origin(hint) is typing.Annotated:
        args = typing.get_args(hint)
        hint, meta = args[0], meta + tuple(args[1:])
    return hint, meta


def _is_marker(item: Any, name: str) -> bool:
    import tyro

    return item is getattr(tyro.conf, name, object())


def _is_arg_config(item: Any) -> bool:
    """A `tyro.conf.arg(...)` record (its class is private: matched by the fields it has)."""
    return hasattr(item, "name") and hasattr(item, "metavar") and hasattr(item, "help")


# ----------------------------------------------------------------------------- types in words

_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          bool: ("true or false", "true/false values")}  # fmt: skip


def type_words(hint: Any, plural: bool = False) -> str:
    """What a flag of type `hint` takes, in words: `int | None` -> "an integer (or None)"."""
    hint, _ = _strip(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        arms = [arg for arg in args if arg is not type(None)]
        words = " or ".join(type_words(arm, plural) for arm in arms)
        return f"{words} (or None)" if len(arms) < len(args) else words
    if origin in (tuple, list, set, frozenset) or hint in (tuple, list):
        items = [arg for arg in args if arg is not Ellipsis] or [str]
        return f"a list of {type_words(items[0], plural=True)}"
    if hint in _WORDS:
        return _WORDS[hint][plural]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(member.name for member in hint)
    if isinstance(hint, type) and issubclass(hint, os.PathLike):
        return "paths" if plural else "a path"
    return getattr(hint, "__name__", str(hint))


def metavar(flag: Flag) -> str:
    """The flag as the short help writes it: `--seed INT`, `--data.[no-]packing`, `--runtime.device {cpu,cuda}`."""
    hint = flag.hint
    if hint is bool:  # tyro's --x and --no-x, --data.packing and --data.no-packing
        section, dot, last = flag.name[2:].rpartition(".")
        return f"--{section}{dot}[no-]{last}"
    return f"{flag.name} {_metavar(hint)}"


def _metavar(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin in (typing.Union, types.UnionType):
        return "|".join("None" if arm is type(None) else _metavar(arm) for arm in args)
    if origin in (tuple, list, set, frozenset):
        items = [arg for arg in args if arg is not Ellipsis] or [str]
        return f"{_metavar(items[0])} [...]"
    name = getattr(hint, "__name__", str(hint))
    return {"str": "STR", "int": "INT", "float": "FLOAT", "Path": "PATH"}.get(name, name.upper())
