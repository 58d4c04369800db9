"""Layout and atomicity [S36]: step_<N>/ directories, completion, the `latest` pointer, retention, partials
(moved aside, never deleted)."""

from __future__ import annotations

import json
import os

import pytest

from fntrain.checkpoint.layout import (
    DCP_METADATA,
    LATEST,
    MARKER,
    candidates,
    clean_partial,
    find_latest,
    is_complete,
    list_checkpoints,
    step_dir,
    step_of,
    write_json_atomic,
    write_latest,
    write_marker,
)
from fntrain.checkpoint.retention import retain
from fntrain.checkpoint.verify import write_manifest


def make_step_dir(root, step, *, metadata=True, marker=True):
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"data")
    (path / "meta.json").write_text("{}")
    if metadata:
        (path / DCP_METADATA).write_bytes(b"meta")
    if marker:
        write_manifest(path)
        (path / MARKER).write_text("{}")
    return path


def test_step_dir_names():
    assert step_dir("/x", 12).name == "step_12"
    assert step_of("/x/step_12") == 12
    assert step_of("/x/step_12.tmp") is None
    assert step_of("/x/latest") is None


def test_complete_needs_metadata_and_marker(tmp_path):
    assert is_complete(make_step_dir(tmp_path, 1))
    assert not is_complete(make_step_dir(tmp_path, 2, marker=False))
    assert not is_complete(make_step_dir(tmp_path, 3, metadata=False))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1"]


def test_latest_follows_a_pointer_to_a_complete_checkpoint(tmp_path):
    make_step_dir(tmp_path, 4)
    make_step_dir(tmp_path, 8)
    write_latest(tmp_path, step_dir(tmp_path, 4))
    assert find_latest(tmp_path) == step_dir(tmp_path, 4)  # the pointer wins over a higher step


def test_latest_falls_back_to_highest_complete(tmp_path):
    make_step_dir(tmp_path, 4)
    make_step_dir(tmp_path, 10)
    make_step_dir(tmp_path, 12, marker=False)  # a crashed save: ignored
    (tmp_path / LATEST).write_text("step_12\n")  # a pointer to an incomplete checkpoint
    assert find_latest(tmp_path) == step_dir(tmp_path, 10)
    (tmp_path / LATEST).write_text("../../etc\n")  # never followed outside the root
    assert find_latest(tmp_path) == step_dir(tmp_path, 10)
    (tmp_path / LATEST).unlink()
    assert find_latest(tmp_path) == step_dir(tmp_path, 10)  # numeric order, not lexical


def test_latest_is_none_without_checkpoints(tmp_path):
    assert find_latest(tmp_path / "missing") is None
    make_step_dir(tmp_path, 3, marker=False)
    assert find_latest(tmp_path) is None


def test_marker_refused_before_dcp_metadata(tmp_path):
    path = make_step_dir(tmp_path, 5, metadata=False, marker=False)
    with pytest.raises(RuntimeError, match="metadata"):
        write_marker(path, {"step": 5})
    assert not (path / MARKER).exists()
    (path / DCP_METADATA).write_bytes(b"meta")
    write_marker(path, {"step": 5})
    assert json.loads((path / MARKER).read_text()) == {"step": 5}
    assert is_complete(path)


def test_latest_pointer_refuses_incomplete_and_replaces_atomically(tmp_path):
    partial = make_step_dir(tmp_path, 7, marker=False)
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        write_latest(tmp_path, partial)
    assert not (tmp_path / LATEST).exists()
    write_latest(tmp_path, make_step_dir(tmp_path, 3))
    write_latest(tmp_path, make_step_dir(tmp_path, 6))
    assert (tmp_path / LATEST).read_text() == "step_6\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_retention_keeps_newest_complete_and_partials(tmp_path):
    for step in (2, 4, 6, 8):
        make_step_dir(tmp_path, step)
    make_step_dir(tmp_path, 10, marker=False)  # maybe an async save in flight: never touched by retention
    removed = retain(tmp_path, 2)
    assert [p.name for p in removed] == ["step_2", "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_10", "step_6", "step_8"]
    assert retain(tmp_path, 0) == []  # 0 keeps all
    retain(tmp_path, 1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_8"]  # the newest complete survives


def test_retention_never_removes_the_checkpoint_just_saved(tmp_path):
    """Resumed from step 4 of a run that had gone on to 12: saving step 8 again must not lose it."""
    for step in (4, 8, 12):
        make_step_dir(tmp_path, step)
    removed = retain(tmp_path, 1, protect=step_dir(tmp_path, 8))
    assert sorted(p.name for p in removed) == ["step_4"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_8", "step_12"]


def test_clean_partial_moves_incomplete_aside_never_deletes(tmp_path):
    make_step_dir(tmp_path, 1)
    make_step_dir(tmp_path, 2, marker=False)
    make_step_dir(tmp_path, 3, metadata=False, marker=False)
    (tmp_path / "step_3.incomplete").mkdir()  # set aside by an earlier restore: the name is taken
    step_dir(tmp_path, 4).mkdir()  # empty: nothing to keep
    (tmp_path / f".{LATEST}.tmp-123").write_text("step_3")
    (tmp_path / "notes").mkdir()
    moved = clean_partial(tmp_path)
    assert sorted(p.name for p in moved) == ["step_2.incomplete", "step_3.incomplete.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes", "step_1", "step_2.incomplete", "step_3.incomplete", "step_3.incomplete.1",
    ]  # fmt: skip
    assert (tmp_path / "step_2.incomplete" / "__0_0.distcp").read_bytes() == b"data"  # the bytes are kept
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]  # set-aside names are no checkpoints


def test_candidates_follow_the_pointer_then_older_steps(tmp_path):
    for step in (2, 4, 6, 8):
        make_step_dir(tmp_path, step)
    assert [p.name for p in candidates(tmp_path)] == ["step_8", "step_6", "step_4", "step_2"]
    write_latest(tmp_path, step_dir(tmp_path, 4))  # resumed behind a longer attempt: 6 and 8 are not tried
    assert [p.name for p in candidates(tmp_path)] == ["step_4", "step_2"]


def test_retention_never_counts_or_deletes_what_it_cannot_verify(tmp_path, caplog):
    for step in (2, 4, 6, 8, 10):
        make_step_dir(tmp_path, step)
    (step_dir(tmp_path, 10) / "__0_0.distcp").write_bytes(b"da")  # truncated
    (step_dir(tmp_path, 8) / "__0_0.distcp").write_bytes(b"DATA")  # changed, same size
    legacy = step_dir(tmp_path, 6)
    (legacy / "manifest.json").unlink()  # saved by an older fntrain: cannot be verified
    make_step_dir(tmp_path, 12, marker=False)  # maybe an async save in flight
    removed = retain(tmp_path, 2, protect=make_step_dir(tmp_path, 14))
    assert [p.name for p in removed] == ["step_2"]  # 14 (just saved) and 4 are the newest verified two
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_10.damaged", "step_12", "step_14", "step_4", "step_6", "step_8.damaged",
    ]  # fmt: skip
    assert (tmp_path / "step_8.damaged" / "__0_0.distcp").read_bytes() == b"DATA"
    assert "step_10" in caplog.text and "truncated" in caplog.text and "changed: crc32" in caplog.text


def test_json_written_atomically(tmp_path, monkeypatch):
    target = tmp_path / "meta.json"
    write_json_atomic(target, {"a": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1}  # the old file, whole
