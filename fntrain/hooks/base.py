"""Small combinators that compose hooks, and the `state_dict` protocol hooks use to survive a resume.

A hook is any callable `(event, state, info) -> None`. A hook with state that must survive a resume
(consumed tokens, the last saved step, ...) is a `StatefulHook`: it carries a stable `name` and the
`state_dict` / `load_state_dict` pair, which the checkpoint saves and restores by that name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fntrain.loop import Event, Hook
from fntrain.state import TrainState

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


@dataclass(frozen=True)
class StatefulHook:
    """A named hook whose state the checkpoint saves (`state_dict`) and restores (`load_state_dict`)."""

    name: str
    fn: Callable[[Event, TrainState, Any], None]
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[Mapping[str, Any]], None]

    def __call__(self, event: Event, state: TrainState, info: Any) -> None:
        self.fn(event, state, info)


def stateful(
    name: str,
    fn: Callable[[Event, TrainState, Any], None],
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[Mapping[str, Any]], None],
) -> StatefulHook:
    """Wrap a hook function with the resume protocol under a stable `name`."""
    return StatefulHook(name, fn, state_dict, load_state_dict)


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


def hook_states(hooks: Iterable[Hook]) -> dict[str, dict[str, Any]]:
    """The `state_dict()` of every stateful hook, keyed by its name; duplicate names are an error."""
    states: dict[str, dict[str, Any]] = {}
    for hook in hooks:
        if isinstance(hook, StatefulHook):
            if hook.name in states:
                raise ValueError(f"two hooks share the state name {hook.name!r}")
            states[hook.name] = hook.state_dict()
    return states


def load_hook_states(hooks: Iterable[Hook], states: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Give each stateful hook its saved state; return the names of hooks that had none saved."""
    missing = []
    for hook in hooks:
        if isinstance(hook, StatefulHook):
            if hook.name in states:
                hook.load_state_dict(states[hook.name])
            else:
                missing.append(hook.name)
    return missing
