"""Pins for fntrain/checkpoint/layout.py that mutation testing showed unpinned: which checkpoint
"latest" names (a step_0 checkpoint too), where checkpoints live, what a temporary marker says, what a
restore cleans up and the warnings it gives, the name a partial is moved aside to, and that a JSON file's
bytes do not depend on the order its keys were built in."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from fntrain.checkpoint.layout import (
    DCP_METADATA,
    LATEST,
    candidates,
    checkpoint_root,
    clean_partial,
    find_latest,
    is_temporary,
    write_json_atomic,
    write_marker,
)


def _complete(root: Path, step: int, **marker: object) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"meta")
    write_marker(path, {"step": step, **marker})
    return path


def test_latest_without_a_pointer_is_the_highest_complete_checkpoint(tmp_path):
    for step in (1, 3, 2):
        _complete(tmp_path, step)
    assert find_latest(tmp_path) == tmp_path / "step_3"
    assert candidates(tmp_path) == [tmp_path / "step_3", tmp_path / "step_2", tmp_path / "step_1"]
    assert find_latest(tmp_path / "nothing-here") is None


def test_a_pointer_to_an_incomplete_checkpoint_is_ignored_naming_both(tmp_path, caplog):
    for step in (1, 2):
        _complete(tmp_path, step)
    (tmp_path / "step_5").mkdir()
    (tmp_path / LATEST).write_text("step_5\n")
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert find_latest(tmp_path) == tmp_path / "step_2"
        assert candidates(tmp_path) == [tmp_path / "step_2", tmp_path / "step_1"]
    warnings = [r.getMessage() for r in caplog.records if "not a complete checkpoint" in r.getMessage()]
    assert len(warnings) == 2
    assert all(str(tmp_path / LATEST) in w and "'step_5'" in w and "ignoring it" in w for w in warnings)


def test_a_valid_pointer_leads_and_only_checkpoints_below_it_follow(tmp_path):
    for step in (1, 2, 4):
        _complete(tmp_path, step)
    (tmp_path / LATEST).write_text("step_2\n")
    assert candidates(tmp_path) == [tmp_path / "step_2", tmp_path / "step_1"]
    assert find_latest(tmp_path) == tmp_path / "step_2"


def test_checkpoints_live_under_the_run_dir_unless_a_directory_is_given(tmp_path):
    assert checkpoint_root(SimpleNamespace(dir=None), tmp_path / "run") == tmp_path / "run" / "checkpoints"
    assert checkpoint_root(SimpleNamespace(dir=""), tmp_path / "run") == tmp_path / "run" / "checkpoints"
    assert checkpoint_root(SimpleNamespace(dir=str(tmp_path / "ck")), tmp_path / "run") == tmp_path / "ck"


def test_a_marker_says_whether_the_checkpoint_is_temporary(tmp_path):
    assert is_temporary(_complete(tmp_path, 1, temporary=True))
    assert not is_temporary(_complete(tmp_path, 2, temporary=False))
    assert not is_temporary(_complete(tmp_path, 3))
    broken = tmp_path / "step_4"
    broken.mkdir()
    (broken / "COMPLETE").write_text("not json")
    assert not is_temporary(broken) and not is_temporary(tmp_path / "missing")
    assert json.loads((tmp_path / "step_1" / "COMPLETE").read_text())["temporary"] is True


def test_every_interrupted_save_is_moved_aside_and_stale_pointer_temps_go(tmp_path, caplog):
    _complete(tmp_path, 1)
    for step in (2, 3):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "shard").write_bytes(b"x")
    (tmp_path / "step_4").mkdir()  # empty: removed, nothing to lose
    (tmp_path / f".{LATEST}.tmp-123").write_text("step_1")
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        moved = clean_partial(tmp_path)
    assert [path.name for path in moved] == ["step_2.incomplete", "step_3.incomplete"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2.incomplete", "step_3.incomplete"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(tmp_path / "step_2") in m and "moved aside to step_2.incomplete" in m for m in messages)
    assert clean_partial(tmp_path / "absent") == []


def _partial(root: Path, step: int) -> Path:
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "shard").write_bytes(b"x")
    return path


def test_the_warnings_a_user_reads_are_exact(tmp_path, caplog):
    """A pointer to no complete checkpoint (resolved by find_latest and by candidates) and an interrupted
    save moved aside are each one warning naming the files."""
    _complete(tmp_path, 1)
    (tmp_path / LATEST).write_text("step_9\n")
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        find_latest(tmp_path)
        candidates(tmp_path)
        _partial(tmp_path, 2)
        clean_partial(tmp_path)
    ignored = f"checkpoint pointer {tmp_path / LATEST} names 'step_9', which is not a complete checkpoint; ignoring it"
    assert [r.getMessage() for r in caplog.records] == [
        ignored, ignored,
        f"checkpoint {tmp_path / 'step_2'} has no completion marker (left by an interrupted save); moved aside to "
        "step_2.incomplete",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "steps, pointer, want",
    [
        ((0, 1, 2), "step_0", ["step_0"]),
        ((0, 1, 2), "step_1", ["step_1", "step_0"]),
        ((0, 2), "step_2", ["step_2", "step_0"]),
    ],
)
def test_a_checkpoint_of_step_0_is_tried_once_and_below_any_later_pointer(tmp_path, steps, pointer, want):
    for step in steps:
        _complete(tmp_path, step)
    (tmp_path / LATEST).write_text(pointer + "\n")
    assert [path.name for path in candidates(tmp_path)] == want


def test_an_empty_interrupted_save_does_not_stop_the_cleanup_of_later_ones(tmp_path):
    _complete(tmp_path, 1)
    (tmp_path / "step_2").mkdir()  # empty: removed
    _partial(tmp_path, 3)
    assert [path.name for path in clean_partial(tmp_path)] == ["step_3.incomplete"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_3.incomplete"]


def test_moving_aside_takes_the_next_free_number(tmp_path):
    for name in ("step_3.incomplete", "step_3.incomplete.1", "step_3.incomplete.2"):
        (tmp_path / name).mkdir()
    _partial(tmp_path, 3)
    assert [path.name for path in clean_partial(tmp_path)] == ["step_3.incomplete.3"]
    assert (tmp_path / "step_3.incomplete.3" / "shard").read_bytes() == b"x"


def test_a_stale_pointer_temp_removed_meanwhile_is_no_error(tmp_path, monkeypatch):
    """Another process cleaning the same root (a second restore of it) may remove a stale temp file between
    this one's listing and removal: no error."""
    (tmp_path / f".{LATEST}.tmp-1").write_text("step_1")
    listed = list(tmp_path.glob(f".{LATEST}.tmp-*"))
    (tmp_path / f".{LATEST}.tmp-1").unlink()  # the other cleaner was first
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(listed))
    assert clean_partial(tmp_path) == []


@pytest.mark.parametrize("nested", [{"z": 1, "a": {"y": 2, "b": 3}}, {"a": {"b": 3, "y": 2}, "z": 1}])
def test_a_json_file_is_the_same_bytes_whatever_order_its_keys_were_built_in(tmp_path, nested):
    write_json_atomic(tmp_path / "meta.json", {"state": nested, "config": {"b": 1, "a": 2}})
    assert (tmp_path / "meta.json").read_text() == (
        '{\n"config": {"a": 2, "b": 1},\n"state": {"a": {"b": 3, "y": 2}, "z": 1}\n}\n'
    )
