"""Validation helpers whose errors name the dotted field and the value.

tyro checks types from annotations; the value rules (ranges, choices, exact types where `bool` must not
pass for `int`) live in each config's `validate` and use these helpers, so every message reads like
`profiler.start_step must be an int, got True`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = [
    "ConfigError",
    "flag_name",
    "as_flags",
    "first_line",
    "require_bool",
    "require_bool_or_none",
    "require_int",
    "require_float",
    "require_float_tuple",
    "require_choice",
    "require_str",
    "require_int_list",
    "inputs_optional",
    "absent_input",
    "flatten",
]

# The inputs found missing inside `inputs_optional()`; None outside it (a missing input is an error).
_ABSENT_INPUTS: ContextVar[list[str] | None] = ContextVar("fntrain_absent_inputs", default=None)


class ConfigError(ValueError):
    """A setting that is wrong for this run, found after parsing (e.g. a batch shape that does not divide
    over the ranks): the command line reports it as one line, exit status 2, like a bad flag."""


@contextmanager
def inputs_optional() -> Iterator[list[str]]:
    """Within this block a missing input file (data, model weights) is recorded, not refused: `fntrain
    plan` plans from the configs alone. Yields the list of what was missing, one line each."""
    token = _ABSENT_INPUTS.set([])
    try:
        yield _ABSENT_INPUTS.get()
    finally:
        _ABSENT_INPUTS.reset(token)


def absent_input(message: str, *, note: bool = True) -> bool:
    """True inside `inputs_optional()`, recording `message` there when `note` (an input the plan would
    read: data); False outside it, where the caller refuses the missing input (raises with `message`)."""
    absent = _ABSENT_INPUTS.get()
    if absent is not None and note:
        absent.append(message)
    return absent is not None


def flag_name(field: str) -> str:
    """The command-line flag of a dotted config field: `train.train_iters` -> `--train.train-iters`."""
    return "--" + field.replace("_", "-")


def as_flags(message: str, fields: Iterable[str]) -> str:
    """`message` with every dotted config field it names written as its flag (`optim.lr` ->
    `--optim.lr`); a top-level field is rewritten where the message starts with it or where it stands
    in backticks (`` `overwrite` `` -> `--overwrite`)."""
    fields = set(fields)
    message = re.sub(
        r"`([\w.]+)`", lambda m: flag_name(m.group(1)) if m.group(1) in fields else m.group(0), message
    )
    dotted = sorted((f for f in fields if "." in f), key=len, reverse=True)
    if dotted:
        pattern = re.compile(r"(?<![\w.\-/'\"])(" + "|".join(map(re.escape, dotted)) + r")(?![\w\-/]|\.\w)")
        message = pattern.sub(lambda match: flag_name(match.group(1)), message)
    first = message.split(" ", 1)[0]
    if first in fields and "." not in first:
        message = flag_name(first) + message[len(first) :]
    return message


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its class name when it has none): how a library's
    multi-line message goes into a one-line error."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def require_bool(field: str, value: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{field} must be a bool, got {value!r}")
    return value


def require_bool_or_none(field: str, value: Any) -> bool | None:
    """A bool or None (ints, strings rejected)."""
    if value is not None and type(value) is not bool:
        raise TypeError(f"{field} must be a bool or None, got {value!r}")
    return value


def require_int(field: str, value: Any, *, min: int | None = None, max: int | None = None) -> int:
    """An int (bools rejected) within [min, max] when given."""
    if type(value) is not int:
        raise TypeError(f"{field} must be an int, got {value!r}")
    if min is not None and value < min:
        raise ValueError(f"{field} must be >= {min}, got {value}")
    if max is not None and value > max:
        raise ValueError(f"{field} must be <= {max}, got {value}")
    return value


def require_float(
    field: str, value: Any, *, min: float | None = None, max: float | None = None, min_exclusive: bool = False
) -> float:
    """A finite real number (int or float; bools, NaN and infinities rejected) within the bounds given."""
    if type(value) not in (int, float):
        raise TypeError(f"{field} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{field} must be a finite number, got {value}")
    if min is not None and (value <= min if min_exclusive else value < min):
        raise ValueError(f"{field} must be {'>' if min_exclusive else '>='} {min}, got {value}")
    if max is not None and value > max:
        raise ValueError(f"{field} must be <= {max}, got {value}")
    return float(value)


def require_choice(field: str, value: Any, choices: Collection[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{field} must be one of {sorted(map(str, choices))}, got {value!r}")
    return value


def require_str(field: str, value: Any, *, optional: bool = False, non_empty: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str{' or None' if optional else ''}, got {value!r}")
    if non_empty and not value:
        raise ValueError(f"{field} must not be empty")
    return value


def require_int_list(
    field: str, value: Any, *, min: int | None = None, max_exclusive: int | None = None
) -> list[int]:
    """A list/tuple of ints (bools rejected), each in [min, max_exclusive) when given."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{field} must be a list of ints, got {value!r}")
    bad = [v for v in value if type(v) is not int]
    if bad:
        raise TypeError(f"{field} must contain ints, got {list(value)!r}")
    lo = min if min is not None else None
    out_of_range = [
        v for v in value if (lo is not None and v < lo) or (max_exclusive is not None and v >= max_exclusive)
    ]
    if out_of_range:
        if max_exclusive is not None:
            raise ValueError(
                f"{field} must contain integers in [{lo if lo is not None else '-inf'}, {max_exclusive}), "
                f"got {list(value)!r}"
            )
        raise ValueError(f"{field} must contain integers >= {lo}, got {list(value)!r}")
    return list(value)


def require_float_tuple(
    field: str,
    value: Any,
    *,
    length: int | None = None,
    min: float | None = None,
    max: float | None = None,
    max_exclusive: bool = False,
) -> tuple[float, ...]:
    """A list/tuple of finite numbers (bools, NaN and infinities rejected; an item is named `field[i]`),
    of `length` items when given, each within [min, max] (or [min, max) with `max_exclusive`)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{field} must be a tuple of numbers, got {value!r}")
    if length is not None and len(value) != length:
        raise ValueError(f"{field} must have {length} items, got {value!r}")
    items = tuple(require_float(f"{field}[{i}]", item, min=min, max=max) for i, item in enumerate(value))
    if max_exclusive and max is not None:
        for i, item in enumerate(items):
            if item >= max:
                raise ValueError(f"{field}[{i}] must be < {max}, got {item}")
    return items


def flatten(tree: Mapping[str, Any], prefix: str = "", *, expand_lists: bool = False) -> dict[str, Any]:
    """A nested dict as {dotted name: value}. Lists are kept whole, unless `expand_lists` and every item
    is a mapping: then each item flattens under `name[i].` (a checkpoint's per-file facts)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}.", expand_lists=expand_lists))
        elif expand_lists and isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for number, item in enumerate(value):
                flat.update(flatten(item, f"{name}[{number}].", expand_lists=True))
        else:
            flat[name] = value
    return flat
