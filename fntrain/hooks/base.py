"""Small combinators that compose hooks: `every`, `on`, `on_ranks`.

The hook-state protocol (`stateful`, `hook_states`, `load_hook_states`) lives in `fntrain.stateful`,
below the hooks, the data pipeline and the checkpoint code; it is re-exported here for hook authors.
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
    "every",
    "on",
    "on_ranks",
    "hook_states",
    "load_hook_states",
]

_ALWAYS = frozenset({Event.TRAIN_BEGIN, Event.TRAIN_END, Event.ABORT})


def _with_state_of(inner: Hook, outer: Callable[[Event, TrainState, Any], None]) -> Hook:
    """Keep `inner`'s resume protocol when a combinator wraps it."""
    if isinstance(inner, StatefulHook):
        return StatefulHook(inner.name, outer, inner.state_dict, inner.load_state_dict)
    return outer


def every(n: int, hook: Hook) -> Hook:
    """Send STEP_BEGIN / STEP_END to `hook` only on steps whose global_step is a multiple of `n`.

    For STEP_BEGIN the step about to run (global_step + 1) is tested. Every other event passes through.
    """
    if type(n) is not int or n < 1:
        raise ValueError(f"every(n) needs a positive int, got {n!r}")

    def gated(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            if state.global_step % n:
                return
        elif event is Event.STEP_BEGIN and (state.global_step + 1) % n:
            return
        hook(event, state, info)

    return _with_state_of(hook, gated)


def on(events: Event | Iterable[Event], fn: Callable[[TrainState, Any], None]) -> Hook:
    """A hook that calls `fn(state, info)` for the given events only."""
    wanted = frozenset([events] if isinstance(events, Event) else events)

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
