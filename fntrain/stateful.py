"""The hook-state protocol: how a hook's state survives a resume. Standard library only.

A hook is any callable `(event, state, info) -> None`. A hook with state that must survive a resume
(consumed tokens, the last saved step, ...) is a `StatefulHook`: it carries a stable `name` and the
`state_dict` / `load_state_dict` pair, which the checkpoint saves and restores by that name. This module
sits below the hooks, the data pipeline and the checkpoint code, so each can use the protocol without
importing the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StatefulHook", "stateful", "hook_states", "load_hook_states"]


@dataclass(frozen=True)
class StatefulHook:
    """A named hook whose state the checkpoint saves (`state_dict`) and restores (`load_state_dict`)."""

    name: str
    fn: Callable[[Any, Any, Any], None]
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[Mapping[str, Any]], None]

    def __call__(self, event: Any, state: Any, info: Any) -> None:
        self.fn(event, state, info)


def stateful(
    name: str,
    fn: Callable[[Any, Any, Any], None],
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[Mapping[str, Any]], None],
) -> StatefulHook:
    """Wrap a hook function with the resume protocol under a stable `name`."""
    return StatefulHook(name, fn, state_dict, load_state_dict)


def hook_states(hooks: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """The `state_dict()` of every stateful hook, keyed by its name; duplicate names are an error."""
    states: dict[str, dict[str, Any]] = {}
    for hook in hooks:
        if isinstance(hook, StatefulHook):
            if hook.name in states:
                raise ValueError(f"two hooks share the state name {hook.name!r}")
            states[hook.name] = hook.state_dict()
    return states


def load_hook_states(hooks: Iterable[Any], states: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Give each stateful hook its saved state; return the names of hooks that had none saved."""
    missing = []
    for hook in hooks:
        if isinstance(hook, StatefulHook):
            if hook.name in states:
                hook.load_state_dict(states[hook.name])
            else:
                missing.append(hook.name)
    return missing
