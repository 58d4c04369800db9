"""Pins for fntrain/stateful.py (the hook-state protocol) that mutation testing showed unpinned: what a
checkpoint saves of the hooks, and what a resume gives back, by name."""

from __future__ import annotations

import pytest

from fntrain.stateful import StatefulHook, hook_states, load_hook_states, stateful


def _counter(name: str, start: int) -> tuple[StatefulHook, dict]:
    memory = {"count": start, "calls": []}

    def fn(event, state, info) -> None:
        memory["calls"].append((event, state, info))

    def load(saved) -> None:
        memory["count"] = saved["count"]

    return stateful(name, fn, lambda: {"count": memory["count"]}, load), memory


def test_stateful_wraps_the_hook_and_its_state_functions():
    hook, memory = _counter("tokens", 7)
    hook("event", "state", "info")
    assert memory["calls"] == [("event", "state", "info")]
    assert hook.name == "tokens" and hook.state_dict() == {"count": 7}
    hook.load_state_dict({"count": 9})
    assert memory["count"] == 9 and hook.state_dict() == {"count": 9}


def test_hook_states_saves_every_stateful_hook_by_name_and_skips_plain_ones():
    first, _ = _counter("a", 1)
    second, _ = _counter("b", 2)
    assert hook_states([first, lambda *args: None, second]) == {"a": {"count": 1}, "b": {"count": 2}}
    assert hook_states([]) == {}
    with pytest.raises(ValueError, match="two hooks share the state name 'a'"):
        hook_states([first, _counter("a", 3)[0]])


def test_load_hook_states_gives_each_hook_its_own_state_and_names_those_without_one():
    first, memory_a = _counter("a", 0)
    second, memory_b = _counter("b", 0)
    third, memory_c = _counter("c", 5)
    missing = load_hook_states([first, lambda *args: None, second, third], {"a": {"count": 11}, "c": {"count": 13}})
    assert missing == ["b"]
    assert (memory_a["count"], memory_b["count"], memory_c["count"]) == (11, 0, 13)
    assert load_hook_states([first], {}) == ["a"]
