"""Checkpoints that fit the disk [issue 48]: by default a run keeps its newest three checkpoints and the
one of the best validation loss, each deletion one log line naming the checkpoint and why, and only
checkpoints that verify are ever deleted (the crash-safety rules of docs/production.md)."""

from __future__ import annotations

import json
import logging

import pytest

from fntrain.checkpoint import SaveTarget, read_meta, step_dir
from fntrain.checkpoint.layout import DCP_METADATA, MARKER
from fntrain.checkpoint.retention import retain, val_loss_of
from fntrain.checkpoint.verify import write_manifest
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.loop import StepInfo
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from tests.checkpoint import toy
from tests.helpers.checkpoints import saved_steps
from tests.hooks.drive import drive

LOSSES = {2: 1.0, 4: 3.0, 6: 2.0, 8: 2.5}  # evaluated every other step; step 2 is the best


def make_scored_step_dir(root, step, val_loss=None):
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"data")
    (path / DCP_METADATA).write_bytes(b"meta")
    (path / "meta.json").write_text(json.dumps({"step": step, "val_loss": val_loss}))
    write_manifest(path)
    (path / MARKER).write_text("{}")
    return path


def test_the_default_is_the_newest_three_and_the_best():
    config = CheckpointConfig()
    assert (config.keep_last, config.keep_best) == (3, True)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_run_keeps_the_newest_three_and_the_best_and_says_what_it_deleted(tmp_path, caplog, async_save):
    parts = toy.components()
    hooks: list = []
    target = SaveTarget(tmp_path, parts, hooks=lambda: hooks, run_dir=tmp_path, val_loss=LOSSES.get)
    hook = checkpoint_hook(CheckpointConfig(save_every=1, async_save=async_save), target, Runtime())
    hooks.append(hook)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        drive(hook, 9, info=StepInfo({"loss": 0.0}))
    assert saved_steps(tmp_path) == [2, 7, 8, 9]
    assert read_meta(step_dir(tmp_path, 2))["val_loss"] == 1.0 and read_meta(step_dir(tmp_path, 9))["val_loss"] is None
    removed = [m for m in caplog.messages if m.startswith("removed")]
    assert removed[0] == f"removed old checkpoint {step_dir(tmp_path, 1)} (keep_last=3: not among the newest 3)"
    assert removed[1:] == [  # once step 2 is older than the newest three, it stays for its loss alone
        f"removed old checkpoint {step_dir(tmp_path, s)} (keep_last=3: not among the newest 3; step_2 is kept as "
        "the best val_loss, 1)" for s in (3, 4, 5, 6)
    ]  # fmt: skip


def test_retain_keeps_the_lowest_recorded_val_loss_and_the_newest_of_equals(tmp_path):
    for step, loss in ((1, 2.0), (2, 0.5), (3, None), (4, 0.5), (5, 3.0), (6, None), (7, None)):
        make_scored_step_dir(tmp_path, step, loss)
    removed = retain(tmp_path, 2, keep_best=True)
    assert [p.name for p in removed] == ["step_1", "step_2", "step_3", "step_5"]
    assert saved_steps(tmp_path) == [4, 6, 7]


def test_without_keep_best_or_any_evaluation_only_the_newest_stay(tmp_path):
    for step in (1, 2, 3, 4):
        make_scored_step_dir(tmp_path, step, 1.0 / step if step < 3 else None)
    assert retain(tmp_path, 2) == [step_dir(tmp_path, 1), step_dir(tmp_path, 2)]
    for step in (5, 6):
        make_scored_step_dir(tmp_path, step, None)
    assert [p.name for p in retain(tmp_path, 1, keep_best=True)] == ["step_3", "step_4", "step_5"]


def test_the_checkpoint_just_saved_and_the_best_both_stay(tmp_path):
    """Resumed from step 3 of a run that had reached 4: step 3 (latest) stays, and so does the best."""
    for step, loss in ((1, 0.9), (2, 0.1), (3, 0.8), (4, 0.7)):
        make_scored_step_dir(tmp_path, step, loss)
    assert retain(tmp_path, 1, protect=step_dir(tmp_path, 3), keep_best=True) == [step_dir(tmp_path, 1)]
    assert saved_steps(tmp_path) == [2, 3, 4]


def test_a_damaged_best_is_moved_aside_not_kept_as_best(tmp_path):
    for step, loss in ((1, 0.1), (2, 0.9), (3, 0.8)):
        make_scored_step_dir(tmp_path, step, loss)
    (step_dir(tmp_path, 1) / "__0_0.distcp").write_bytes(b"DATA")
    assert retain(tmp_path, 1, keep_best=True) == [step_dir(tmp_path, 2)]  # step 3: the newest and best left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1.damaged", "step_3"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", True, None])
def test_only_a_finite_number_is_a_recorded_val_loss(tmp_path, value):
    path = step_dir(tmp_path, 1)
    path.mkdir()
    (path / "meta.json").write_text(json.dumps({"val_loss": value}))
    assert val_loss_of(path) is None
    assert val_loss_of(tmp_path / "nowhere") is None


def test_a_checkpoint_records_the_val_loss_of_its_own_step_only(tmp_path):
    from fntrain.hooks.metrics_log import MetricsLog
    from fntrain.hooks.standard import _val_loss_at

    writer = MetricsLog(enabled=True)
    at = _val_loss_at(writer)
    assert at(2) is None
    writer.write(2, 0, {"val_loss": 1.5, "val_ppl": 4.5})
    writer.write(3, 0, {"loss": 1.0})  # a later record without val_loss does not hide step 2's
    assert (at(2), at(3)) == (1.5, None)
    assert writer.last_value("val_loss") == (2, 1.5) and writer.last_value("loss") == (3, 1.0)
    assert writer.last_value("step") is None  # the record's position is no metric
