"""The three kinds of entry of the flag table (tests/cli/flag_table.py), and small check builders.

- `Effect(values, checks)`: two runs, one per value; each check asserts one promised effect of the flag
  from the two `Outcome`s (tests/cli/flag_runs.py); with `read=True`, the inputs two runs would read (two
  `Read`s, no model: a data flag's effect).
- `Inert(reason, values)`: the flag changes no number: the two runs' losses and final weights are equal.
- `TestedElsewhere(test, why)`: the effect cannot be seen in one CPU process; `test` ("path::name"), whose
  source names the flag, checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Check = Callable[[Any, Any], None]


@dataclass(frozen=True)
class Effect:
    """Run the recipe with `base` then the flag at each of `values`; every check must hold. `before`: the
    flags of a run in the same run directory first (resume, overwrite). `slow`: in the slow tier, as is
    every entry that runs, but for the few of DEFAULT_TIER (tests/cli/test_flag_effects.py)."""

    values: tuple[Any, Any]
    checks: tuple[Check, ...]
    base: tuple[str, ...] = ()
    before: tuple[str, ...] | None = None
    slow: bool = False
    recipe: str | None = None  # a shared flag shown on another recipe than tiny_gpt
    read: bool = False  # observe the inputs a run reads (FlagRuns.read), not a run


@dataclass(frozen=True)
class Inert:
    """The flag does not change the numbers (`reason`): runs at both `values` have equal losses and weights."""

    reason: str
    values: tuple[Any, Any]
    base: tuple[str, ...] = ()
    slow: bool = False


@dataclass(frozen=True)
class TestedElsewhere:
    """`test` ("tests/path.py::test_name") checks the effect, which needs what one CPU process lacks (`why`)."""

    test: str
    why: str
    slow: bool = False
    __test__ = False  # not a pytest class


def flag_args(flag: str, value: Any) -> tuple[str, ...]:
    """The command-line words that set `flag` to `value` (bools as --x / --no-x, sequences as words)."""
    if isinstance(value, bool):
        section, _, name = flag[2:].rpartition(".")
        return (f"--{section}.{'' if value else 'no-'}{name}" if section else f"--{'' if value else 'no-'}{name}",)
    if isinstance(value, (tuple, list)):
        return (flag, *map(str, value))
    return (flag, str(value))


def named(name: str, check: Check) -> Check:
    """`check` under `name` (the name a failure reports)."""
    check.__name__ = check.__qualname__ = name
    return check


def values_differ(name: str, read: Callable[[Any], Any]) -> Check:
    """A check that what `read` sees differs between the two runs."""

    def check(first: Any, second: Any) -> None:
        a, b = read(first.ok()), read(second.ok())
        assert not same(a, b), f"{name}: the same under both values: {a!r}"

    return named(name, check)


def same(a: Any, b: Any) -> bool:
    """Equal, tensors and containers of them included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b

