"""Behaviours of checkpoint retention that mutation testing found unpinned (mutation/RESULTS.md): which
temporary checkpoints a newer one supersedes, what happens to one that cannot be verified or moved
aside, and the log lines that say what was removed, kept or moved."""

from __future__ import annotations

import json
import logging

import pytest

from fntrain.checkpoint import retention
from fntrain.checkpoint.layout import DCP_METADATA, MARKER, list_checkpoints, step_dir
from fntrain.checkpoint.retention import remove_superseded_temporary, retain
from fntrain.checkpoint.verify import write_manifest


def make_manifested_step_dir(root, step, *, temporary=False, marker=True):
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"data")
    (path / DCP_METADATA).write_bytes(b"meta")
    write_manifest(path)
    if marker:
        (path / MARKER).write_text(json.dumps({"temporary": True} if temporary else {}))
    return path


def names(root):
    return sorted(p.name for p in root.iterdir())


def test_a_complete_checkpoint_supersedes_older_temporary_ones_only(tmp_path, caplog):
    make_manifested_step_dir(tmp_path, 2, temporary=True)
    make_manifested_step_dir(tmp_path, 3)  # permanent: stays
    make_manifested_step_dir(tmp_path, 4, temporary=True)
    newest = make_manifested_step_dir(tmp_path, 6, temporary=True)  # the one just completed: never removed itself
    make_manifested_step_dir(tmp_path, 8, temporary=True)  # a higher step (an earlier attempt): not superseded
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        removed = remove_superseded_temporary(tmp_path, newest)
    assert [p.name for p in removed] == ["step_2", "step_4"]
    assert names(tmp_path) == ["step_3", "step_6", "step_8"]
    assert f"removed temporary checkpoint {step_dir(tmp_path, 2)} (superseded by step_6)" in caplog.messages


def test_nothing_is_superseded_by_an_incomplete_or_unnamed_checkpoint(tmp_path):
    make_manifested_step_dir(tmp_path, 2, temporary=True)
    assert remove_superseded_temporary(tmp_path, make_manifested_step_dir(tmp_path, 5, marker=False)) == []
    assert remove_superseded_temporary(tmp_path, tmp_path / "export") == []
    assert names(tmp_path) == ["step_2", "step_5"]


def test_a_damaged_temporary_checkpoint_is_moved_aside_not_deleted(tmp_path, caplog):
    old = make_manifested_step_dir(tmp_path, 2, temporary=True)
    (old / "__0_0.distcp").write_bytes(b"da")
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert remove_superseded_temporary(tmp_path, make_manifested_step_dir(tmp_path, 4)) == []
    assert names(tmp_path) == ["step_2.damaged", "step_4"]
    message = caplog.messages[0]
    assert message.startswith(f"checkpoint {old} is damaged (") and "truncated" in message
    assert message.endswith("); not deleted, moved aside to step_2.damaged")


def test_retain_logs_what_it_removes_and_ignores_a_negative_keep_last(tmp_path, caplog):
    for step in (1, 2, 3):
        make_manifested_step_dir(tmp_path, step)
    assert retain(tmp_path, -1) == []
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        assert [p.name for p in retain(tmp_path, 1)] == ["step_1", "step_2"]
    assert caplog.messages == [
        f"removed old checkpoint {step_dir(tmp_path, 1)} (keep_last=1: not among the newest 1)",
        f"removed old checkpoint {step_dir(tmp_path, 2)} (keep_last=1: not among the newest 1)",
    ]


def test_a_checkpoint_that_cannot_be_verified_is_kept_with_a_warning(tmp_path, caplog, monkeypatch):
    for step in (1, 2):
        make_manifested_step_dir(tmp_path, step)

    def broken(path):
        raise PermissionError("no read")

    monkeypatch.setattr(retention, "verified", broken)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert retain(tmp_path, 1) == []
    assert caplog.messages[0] == (
        f"could not verify checkpoint {step_dir(tmp_path, 2)} ({PermissionError('no read')!r}); keeping it"
    )
    assert len(list_checkpoints(tmp_path)) == 2


def test_a_checkpoint_without_manifest_is_kept_and_said_so(tmp_path, caplog):
    for step in (1, 2):
        make_manifested_step_dir(tmp_path, step)
    (step_dir(tmp_path, 1) / "manifest.json").unlink()
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        assert retain(tmp_path, 1) == []
    assert (f"checkpoint {step_dir(tmp_path, 1)} has no manifest (saved by an older fntrain): not counted "
            "toward keep_last") in caplog.messages


def test_a_damaged_checkpoint_that_cannot_be_moved_is_kept_with_a_warning(tmp_path, caplog, monkeypatch):
    for step in (1, 2):
        make_manifested_step_dir(tmp_path, step)
    (step_dir(tmp_path, 1) / "__0_0.distcp").write_bytes(b"DATA")

    def refuse(path, suffix):
        raise OSError("read-only file system")

    monkeypatch.setattr(retention, "move_aside", refuse)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert retain(tmp_path, 1) == []
    assert names(tmp_path) == ["step_1", "step_2"]
    message = caplog.messages[0]
    assert message.startswith(f"checkpoint {step_dir(tmp_path, 1)} is damaged (") and "changed: crc32" in message
    assert message.endswith(
        f"); not counted toward keep_last, and it could not be moved aside: {OSError('read-only file system')!r}"
    )


@pytest.mark.parametrize("keep", [1, 2])
def test_retain_returns_the_removed_oldest_first(tmp_path, keep):
    for step in (1, 2, 3, 4):
        make_manifested_step_dir(tmp_path, step)
    removed = retain(tmp_path, keep)
    assert removed == [step_dir(tmp_path, s) for s in range(1, 5 - keep)]


def test_step_0_is_superseded_and_the_newest_is_never_removed_however_it_is_spelled(tmp_path, monkeypatch):
    make_manifested_step_dir(tmp_path, 0, temporary=True)
    make_manifested_step_dir(tmp_path, 1, temporary=True)
    monkeypatch.chdir(tmp_path)
    removed = remove_superseded_temporary(tmp_path, "step_1")  # relative: not equal to the listed path
    assert removed == [step_dir(tmp_path, 0)]
    assert names(tmp_path) == ["step_1"]


def test_the_protected_checkpoint_counts_once_toward_keep_last(tmp_path):
    """Resumed from step 8 of a run that had reached 12: 12 and 8 are the two kept, 4 goes."""
    for step in (4, 8, 12):
        make_manifested_step_dir(tmp_path, step)
    assert retain(tmp_path, 2, protect=step_dir(tmp_path, 8)) == [step_dir(tmp_path, 4)]


def test_a_checkpoint_that_cannot_be_deleted_does_not_stop_the_run(tmp_path, monkeypatch):
    import os

    for step in (1, 2, 3):
        make_manifested_step_dir(tmp_path, step, temporary=True)
    unlink = os.unlink

    def refuse(path, *args, **kwargs):  # a file the file system will not let go of
        if str(path) == "__0_0.distcp":
            raise PermissionError("busy")
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)
    assert len(retain(tmp_path, 2)) == 1
    assert len(remove_superseded_temporary(tmp_path, step_dir(tmp_path, 3))) == 1


def test_a_removal_that_fails_part_way_leaves_no_half_checkpoint_and_says_what_is_left(tmp_path, caplog, monkeypatch):
    for step in (1, 2):
        make_manifested_step_dir(tmp_path, step)
    real_rmtree = retention.shutil.rmtree

    def fail_after_one_file(path, *args, **kwargs):
        (path / "__0_0.distcp").unlink()  # part of it goes, then the file system refuses the rest
        raise OSError("device busy")

    monkeypatch.setattr(retention.shutil, "rmtree", fail_after_one_file)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        removed = retain(tmp_path, 1)
    monkeypatch.setattr(retention.shutil, "rmtree", real_rmtree)
    assert removed == [step_dir(tmp_path, 1)]  # no longer a checkpoint: never listed, resumed from or counted
    assert names(tmp_path) == ["step_1.removing", "step_2"]
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 2)]
    assert caplog.messages == [
        f"old checkpoint {step_dir(tmp_path, 1)} (keep_last=1: not among the newest 1) was only partly deleted: "
        f"{tmp_path / 'step_1.removing'} is left ({OSError('device busy')!r})"
    ]


def test_a_checkpoint_that_cannot_be_renamed_for_removal_is_kept_and_not_reported_removed(tmp_path, caplog, monkeypatch):
    make_manifested_step_dir(tmp_path, 2, temporary=True)
    newest = make_manifested_step_dir(tmp_path, 4)

    def refuse(path, suffix):
        raise OSError("read-only file system")

    monkeypatch.setattr(retention, "move_aside", refuse)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert remove_superseded_temporary(tmp_path, newest) == []
    assert names(tmp_path) == ["step_2", "step_4"]
    assert caplog.messages == [
        f"could not remove temporary checkpoint {step_dir(tmp_path, 2)} (superseded by step_4): "
        f"{OSError('read-only file system')!r}; it is kept"
    ]


def test_a_damaged_newest_checkpoint_that_cannot_be_moved_never_counts_as_one_kept(tmp_path, caplog, monkeypatch):
    for step in (1, 2):
        make_manifested_step_dir(tmp_path, step)
    (step_dir(tmp_path, 2) / "__0_0.distcp").write_bytes(b"DATA")  # the newest is damaged
    real_move_aside = retention.move_aside

    def refuse_to_set_aside(path, suffix):
        if suffix == "damaged":
            raise OSError("read-only file system")
        return real_move_aside(path, suffix)

    monkeypatch.setattr(retention, "move_aside", refuse_to_set_aside)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        assert retain(tmp_path, 1) == []  # the intact step 1 is the one kept: it is not deleted
    assert names(tmp_path) == ["step_1", "step_2"]
    assert len(caplog.messages) == 1 and "could not be moved aside" in caplog.messages[0]
