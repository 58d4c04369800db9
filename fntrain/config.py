"""Validation helpers whose errors name the dotted field and the value.

tyro checks types from annotations; the value rules (ranges, choices, exact types where `bool` must not
pass for `int`) live in each config's `validate` and use these helpers, so every message reads like
`profiler.start_step must be an int, got True`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

__all__ = [
    "require_bool",
    "require_int",
    "require_float",
    "require_choice",
    "require_str",
    "require_int_list",
]


def require_bool(field: str, value: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{field} must be a bool, got {value!r}")
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
    """A real number (int or float, bools rejected) within the bounds given."""
    if type(value) not in (int, float):
        raise TypeError(f"{field} must be a number, got {value!r}")
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
