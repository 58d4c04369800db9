"""Small combinators that compose hooks: `every`, `every_epoch`, `on_steps`, `on`, `on_ranks`, `chain`.

A hook is one function; a schedule is a combinator around it, never a flag on every hook (optax's
`chain`, Levanter's cadences). A combinator keeps the resume protocol of the hook it wraps: the wrapper
of a `StatefulHook` is a `StatefulHook` with the same name and state. The hook-state protocol
(`stateful`, `hook_states`, `load_hook_states`) lives in `fntrain.stateful`, below the hooks, the data
pipeline and the checkpoint code; it is re-exported here for hook authors.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from fntrain.loop import Event, Hook
from fntrain.state import TrainState
from fntrain.stateful import StatefulHook, hook_states, load_hook_states, stateful

__all__ = [
    "StatefulHook",
    "stateful",
    "cadence",
    "on_steps",
    "every",
    "every_epoch",
    "on",
    "on_ranks",
    "chain",
    "hook_states",
    "load_hook_states",
]


def _with_state_of(inner: Hook, outer: Callable[[Event, TrainState, Any], None]) -> Hook:
    """Keep `inner`'s resume protocol when a combinator wraps it."""
    if isinstance(inner, StatefulHook):
        return StatefulHook(inner.name, outer, inner.state_dict, inner.load_state_dict)
    return outer


def cadence(n: int, last_step: int | None = None) -> Callable[[int], bool]:
    """`step -> bool`: the multiples of `n` (0: none), and `last_step` when given (forced, so a run's
    last step always counts whatever the cadence)."""
    if type(n) is not int or n < 0:
        raise ValueError(f"a cadence needs an int >= 0, got {n!r}")

    def due(step: int) -> bool:
        return (n > 0 and step % n == 0) or step == last_step

    return due


def on_steps(due: Callable[[int], bool], hook: Hook) -> Hook:
    """Send STEP_BEGIN / STEP_END to `hook` only for the steps where `due(global_step)`: for STEP_END the
    step just taken, for STEP_BEGIN the step about to run (global_step + 1). Every other event passes."""

    def gated(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            if not due(state.global_step):
                return
        elif event is Event.STEP_BEGIN and not due(state.global_step + 1):
            return
        hook(event, state, info)

    return _with_state_of(hook, gated)


def every(n: int, hook: Hook, *, last_step: int | None = None) -> Hook:
    """Send STEP_BEGIN / STEP_END to `hook` only on steps whose global_step is a multiple of `n` (a
    positive int), and on `last_step` when given. Every other event passes through (see `on_steps`)."""
    if type(n) is not int or n < 1:
        raise ValueError(f"every(n) needs a positive int, got {n!r}")
    return on_steps(cadence(n, last_step), hook)


def every_epoch(n: int, hook: Hook) -> Hook:
    """Send EPOCH_BEGIN / EPOCH_END to `hook` only for every `n`-th epoch (epochs counted from 1: the
    epoch with index e is due when (e + 1) is a multiple of `n`). Every other event passes through."""
    if type(n) is not int or n < 1:
        raise ValueError(f"every_epoch(n) needs a positive int, got {n!r}")

    def gated(event: Event, state: TrainState, info: Any) -> None:
        if (event is Event.EPOCH_END or event is Event.EPOCH_BEGIN) and (state.epoch + 1) % n:
            return
        hook(event, state, info)

    return _with_state_of(hook, gated)


def on(events: Event | Iterable[Event], fn: Callable[[TrainState, Any], None]) -> Hook:
    """A hook that calls `fn(state, info)` for the given events only."""
    if isinstance(events, Event):
        only = events

        def one(event: Event, state: TrainState, info: Any) -> None:
            if event is only:  # identity: no Enum hash on every event of every step
                fn(state, info)

        return one
    wanted = frozenset(events)

    def filtered(event: Event, state: TrainState, info: Any) -> None:
        if event in wanted:
            fn(state, info)

    return filtered


def on_ranks(ranks: Collection[int], rank: int, hook: Hook) -> Hook:
    """`hook` on the listed ranks; on other ranks a no-op (the hook is returned unchanged when selected).

    Only for hooks that take part in no collective: a hook that reduces across ranks must run everywhere.
    """
    if rank in ranks:
        return hook

    def skipped(event: Event, state: TrainState, info: Any) -> None:
        return None

    return _with_state_of(hook, skipped)


def chain(*hooks: Hook) -> Hook:
    """One hook that sends every event to `hooks` in order. At most one of them may be stateful: the
    chain keeps its name and state (two would need two names, so that is a `ValueError`)."""
    parts = tuple(hooks)
    stateful_parts = [hook for hook in parts if isinstance(hook, StatefulHook)]
    if len(stateful_parts) > 1:
        names = [hook.name for hook in stateful_parts]
        raise ValueError(f"chain() takes at most one stateful hook, got {names}")

    def chained(event: Event, state: TrainState, info: Any) -> None:
        for hook in parts:
            hook(event, state, info)

    return _with_state_of(stateful_parts[0], chained) if stateful_parts else chained
