"""Pins for fntrain/checkpoint/layout.py that mutation testing showed unpinned: which checkpoint
"latest" names, where checkpoints live, what a temporary marker says, and what a restore cleans up."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from fntrain.checkpoint.layout import (
    DCP_METADATA,
    LATEST,
    candidates,
    checkpoint_root,
    clean_partial,
    find_latest,
    is_temporary,
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
