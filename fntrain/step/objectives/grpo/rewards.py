"""GRPO's reward functions: loaded from `--grpo.reward-funcs module:function ...` once, before any model
work, then called on each generation batch as TRL 1.16's GRPOTrainer calls them.

    functions = load_reward_functions(config.grpo.reward_funcs)       # a ValueError naming the flag
    rewards = score_completions(functions, prompts, completions, completion_ids, columns,
                                where=lambda i: f"{rows[i // G].where}, completion {i % G + 1} of {G}")
    rewards   # [completions, functions] float32, NaN where a function returned None

A reward function is `fn(prompts, completions, completion_ids, **columns) -> list[float | None]`, called
with keywords only (`fntrain.rewards` documents the convention and holds built-in ones), so a function
written for TRL drops in unchanged. Whatever goes wrong in one is a `RewardError` whose one line names the
function as typed and the completion it failed on.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.config import first_line
from fntrain.data.prompts import REWARD_KEYWORDS

__all__ = ["RewardFunction", "RewardError", "load_reward_functions", "score_completions"]


@dataclass(frozen=True)
class RewardFunction:
    """One loaded reward function."""

    spec: str
    """As typed: "module:function"."""
    name: str
    """The function's `__name__` (TRL's reward_func_names): its metrics are rewards/<name>/mean and /std."""
    fn: Callable[..., Any]


class RewardError(ValueError):
    """A reward function that raised, or returned something other than one finite reward (or None) per
    completion; the message is one line naming the function and the completion."""


# ----------------------------------------------------------------------------- loading


def _importable_cwd() -> None:
    """Put the working directory at the end of sys.path unless it is there (`python -m` puts it first;
    a console script does not), so a reward module beside the data imports without shadowing anything."""
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.append(cwd)


def _import(module_name: str, label: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        reason = first_line(error)
    except Exception as error:  # noqa: BLE001 - whatever a user's module raises while importing
        reason = f"{type(error).__name__}: {first_line(error)}"
    raise ValueError(f"{label}: module {module_name!r} cannot be imported ({reason})")


def _functions_in(module: Any) -> str:
    names = sorted(
        name for name, value in vars(module).items()
        if not name.startswith("_") and inspect.isfunction(value) and value.__module__ == module.__name__
    )  # fmt: skip
    return f" (its functions: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''})" if names else ""


def _load_one(spec: str, label: str) -> RewardFunction:
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{label} must be module:function, got {spec!r}")
    module_name, attribute = spec.split(":")
    module = _import(module_name, label)
    try:
        fn = getattr(module, attribute)
    except AttributeError:
        raise ValueError(
            f"{label}: module {module_name!r} has no {attribute!r}{_functions_in(module)}"
        ) from None
    except Exception as error:  # noqa: BLE001 - a lazy module importing the attribute's own module
        raise ValueError(
            f"{label}: {attribute!r} cannot be imported ({type(error).__name__}: {first_line(error)})"
        ) from None
    if not callable(fn):
        raise ValueError(f"{label}: {attribute!r} is {type(fn).__name__}, not a function")
    return RewardFunction(spec, getattr(fn, "__name__", None) or attribute, fn)


def load_reward_functions(
    specs: Sequence[str], field: str = "grpo.reward_funcs"
) -> tuple[RewardFunction, ...]:
    """Each "module:function" of `specs` imported, in order. The working directory is importable (added
    at the end of sys.path for good when it is not on it), so `my_rewards:accuracy` finds my_rewards.py
    beside the data. A module that cannot be imported, a missing attribute, one that is not callable, or
    two functions of one name (their metrics would collide) is a ValueError naming `field`[i] and the
    spec as typed: `grpo.reward_funcs[1] 'my_rewards:acc': module 'my_rewards' cannot be imported (...)`."""
    _importable_cwd()
    functions: list[RewardFunction] = []
    for index, spec in enumerate(specs):
        label = f"{field}[{index}] {spec!r}"
        function = _load_one(spec, label)
        same = next((i for i, other in enumerate(functions) if other.name == function.name), None)
        if same is not None:
            raise ValueError(
                f"{label}: its name {function.name!r} is also that of {field}[{same}] {functions[same].spec!r}, "
                f"so their metrics (rewards/{function.name}/mean) would collide: wrap one in a function of "
                "another name"
            )
        functions.append(function)
    return tuple(functions)


# ----------------------------------------------------------------------------- calling


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _invoke(fn: Callable[..., Any], batch: Mapping[str, list[Any]], extras: Mapping[str, Any]) -> Any:
    result = fn(**batch, **extras)
    if inspect.isawaitable(result):  # an async reward function (TRL runs those too)
        result = asyncio.run(_awaited(result))
    return result


def _span(where: Callable[[int], str], count: int) -> str:
    return where(0) if count == 1 else f"the {count} completions {where(0)} to {where(count - 1)}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure(
    function: RewardFunction,
    batch: Mapping[str, list[Any]],
    extras: dict[str, Any],
    where: Callable[[int], str],
    error: Exception,
) -> RewardError:
    """The error naming the first completion that raises when the function is called on it alone (no
    logging then); the whole batch when none does."""
    quiet = {**extras, "log_extra": _ignore, "log_metric": _ignore}
    for row in range(len(batch["completions"])):
        try:
            _invoke(function.fn, {key: values[row : row + 1] for key, values in batch.items()}, quiet)
        except Exception as alone:  # noqa: BLE001 - the user's function: any exception is its failure
            return RewardError(
                f"reward function {function.spec!r} raised on {where(row)}: "
                f"{type(alone).__name__}: {first_line(alone)}"
            )
    count = len(batch["completions"])
    return RewardError(
        f"reward function {function.spec!r} raised on {_span(where, count)}, though on none of them alone: "
        f"{type(error).__name__}: {first_line(error)}"
    )


def _reward(function: RewardFunction, value: Any, where: str) -> float:
    """One returned reward as a float (None: NaN, bool: 0/1); anything else a `RewardError`."""
    if value is None:
        return math.nan
    if not isinstance(value, numbers.Real) and getattr(value, "shape", None) == ():
        value = value.item()  # a numpy or torch scalar
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {function.spec!r} returned {_short(value)} ({type(value).__name__}) for "
            f"{where}: a reward is a float, an int, a bool or None"
        )
    if not math.isfinite(value):
        raise RewardError(
            f"reward function {function.spec!r} returned {value!r} for {where}: rewards must be finite "
            "(return None for a completion it cannot score)"
        )
    return float(value)


def _rewards(function: RewardFunction, result: Any, count: int, where: Callable[[int], str]) -> list[float]:
    if hasattr(result, "tolist") and not isinstance(result, (list, tuple)):
        result = result.tolist()  # a 1-d numpy array or tensor
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Sequence):
        raise RewardError(
            f"reward function {function.spec!r} returned {_short(result)} for {_span(where, count)}: "
            f"expected a list of {count} rewards"
        )
    if len(result) != count:
        raise RewardError(
            f"reward function {function.spec!r} returned {len(result)} rewards for {count} completions "
            f"({_span(where, count)}): one per completion, None where it cannot score one"
        )
    return [_reward(function, value, where(row)) for row, value in enumerate(result)]


def _column_lists(columns: Mapping[str, Sequence[Any]], count: int) -> dict[str, list[Any]]:
    """{column: its values as a list}, each one value per completion; a column named like a keyword the
    trainer passes is refused."""
    lists = {name: list(values) for name, values in columns.items()}
    for name, values in lists.items():
        if name in REWARD_KEYWORDS:
            raise ValueError(
                f"column {name!r} would collide with the keyword {name}= the trainer passes itself"
            )
        if len(values) != count:
            raise ValueError(f"column {name!r} has {len(values)} values for {count} completions")
    return lists


def score_completions(
    functions: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    *,
    where: Callable[[int], str],
    trainer_state: Any = None,
    log_metric: Callable[[str, float], None] | None = None,
    log_extra: Callable[[str, list[Any]], None] | None = None,
) -> torch.Tensor:
    """[completions, functions] float32 on the CPU: each function called once on the whole batch with
    TRL's keywords: prompts=, completions=, completion_ids=, each of `columns` ({name: one value per
    completion}, a prompt row's value repeated for its completions), trainer_state=, log_extra= and
    log_metric= (`log_extra(column, values)`, `log_metric(name, value)`; no-ops by default). None becomes
    NaN, a bool 0/1. A function that raises, returns other than one reward per completion, a value that
    is not a number or None, or NaN/inf, is a `RewardError` naming it and the completion (`where(i)`: the
    label of completion i; a raising function is called on each completion alone to find the first that
    raises)."""
    count = len(completions)
    if count == 0:
        return torch.empty(0, len(functions), dtype=torch.float32)
    if not len(prompts) == len(completion_ids) == count:
        raise ValueError(
            f"score_completions needs one prompt and one id list per completion: got {len(prompts)} prompts, "
            f"{len(completion_ids)} id lists and {count} completions"
        )
    batch = {
        "prompts": list(prompts),
        "completions": list(completions),
        "completion_ids": [list(ids) for ids in completion_ids],
        **_column_lists(columns, count),
    }
    extras = {
        "trainer_state": trainer_state,
        "log_extra": log_extra or _ignore,
        "log_metric": log_metric or _ignore,
    }
    scores = torch.empty(count, len(functions), dtype=torch.float32)
    for index, function in enumerate(functions):
        try:
            result = _invoke(function.fn, batch, extras)
        except Exception as error:  # noqa: BLE001 - the user's function: any exception is its failure
            raise _failure(function, batch, extras, where, error) from error
        scores[:, index] = torch.tensor(_rewards(function, result, count, where), dtype=torch.float32)
    return scores
