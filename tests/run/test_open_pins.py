"""Behaviours of opening a run directory (`fntrain.run.open`) that mutation testing found unpinned
(mutation/RESULTS.md): a run that fails before its first step leaves the run directory as it found it
(files it made removed, nested folders included; files it rewrote or removed put back; appended logs cut
back; what it did not touch left alone, modification times included; the checkpoint root never touched),
overwrite's warning and the old run put back, the rank's log file naming its rank and restart, which
launch of the run this is (read on rank 0 alone), and the `Progress` record. In process: no model, no
device, no process group."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from fntrain import Event
from fntrain.checkpoint.space import CheckpointSaveError
from fntrain.run.launch import Launch
from fntrain.run.metadata import METADATA_FILE
from fntrain.run.open import _KEPT_BYTES, Progress, open_run, restore_found, survey
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.helpers.files import file_hashes
from tests.run.test_job import toy

OLD = 1_000_000_000  # a modification time well in the past, set on every file of an earlier run


def earlier_run(run_dir: Path) -> None:
    """A run directory an earlier launch left: top-level files, logs of two ranks, nested folders and
    checkpoints, every file dated OLD."""
    for relative, text in {
        "config.json": '{"a": 1}',
        "metrics.jsonl": '{"step": 2}\n',
        "logs/rank_0.log": "first launch\n",
        "logs/rank_1.log": "rank 1, first launch\n",
        "tensorboard/first/events": "events",
        "checkpoints/latest": "step_2",
        "checkpoints/step_2/model.distcp": "weights",
    }.items():
        path = run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.utime(path, (OLD, OLD))


def tree(root: Path) -> dict[str, float | None]:
    """Every file (with its modification time) and folder (None) under `root`."""
    return {str(p.relative_to(root)): p.stat().st_mtime if p.is_file() else None for p in root.rglob("*")}


def rank_log(run_dir: Path, rank: int) -> str:
    return (run_dir / "logs" / f"rank_{rank}.log").read_text()


def test_a_start_that_fails_before_its_first_step_leaves_the_run_directory_as_found(tmp_path):
    config = toy(tmp_path)
    run_dir = Path(config.run_dir)
    earlier_run(run_dir)
    bytes_before, tree_before = file_hashes(run_dir), tree(run_dir)
    opened = open_run(config, Runtime(), Launch())
    try:  # what a failed start can do before its first step
        (run_dir / "config.json").write_text('{"a": 2}')  # rewritten
        (run_dir / "metrics.jsonl").unlink()  # removed
        (run_dir / "tensorboard" / "second" / "deep").mkdir(parents=True)  # new nested folders
        (run_dir / "tensorboard" / "second" / "deep" / "events").write_text("new events")
        (run_dir / "profile" / "a" / "b").mkdir(parents=True)  # new folders, empty
        assert "=== launch" in rank_log(run_dir, 0)  # appended to
        assert (run_dir / METADATA_FILE).is_file()  # made
    finally:
        opened.close()
    opened.undo()
    assert file_hashes(run_dir) == bytes_before
    assert set(tree(run_dir)) == set(tree_before)  # no file or folder of its own left
    untouched = [
        "logs/rank_1.log",
        "tensorboard/first/events",
        "checkpoints/latest",
        "checkpoints/step_2/model.distcp",
    ]
    assert [tree(run_dir)[name] for name in untouched] == [OLD] * 4  # not even re-dated


def test_the_checkpoint_root_is_out_of_the_transaction(tmp_path):
    config = toy(tmp_path)
    run_dir = Path(config.run_dir)
    earlier_run(run_dir)
    opened = open_run(config, Runtime(), Launch())
    opened.close()
    assert opened.checkpoints == run_dir / "checkpoints"
    assert set(opened.found.sizes) == {"config.json", "metrics.jsonl", "logs/rank_0.log", "logs/rank_1.log",
                                       "tensorboard/first/events"}  # fmt: skip
    (run_dir / "checkpoints" / "step_4").mkdir()
    (run_dir / "checkpoints" / "step_4" / "model.distcp").write_text("not this launch's to remove")
    opened.undo()
    assert (run_dir / "checkpoints" / "step_4" / "model.distcp").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_2"


def test_survey_leaves_out_the_checkpoint_root_wherever_it_is(tmp_path):
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    (run_dir / "ckpt" / "step_2").mkdir(parents=True)
    (run_dir / "ckpt" / "latest").write_text("step_2")
    (run_dir / "ckpt" / "step_2" / "model.distcp").write_text("weights")
    found = survey(run_dir, run_dir / "ckpt")
    assert not any(name.startswith("ckpt") for name in found.sizes)
    assert "checkpoints/latest" in found.sizes  # not the checkpoint root here: surveyed like any folder


def test_survey_keeps_the_bytes_of_small_top_level_files_only(tmp_path):
    run_dir = tmp_path / "run"
    earlier_run(run_dir)
    for name, size in {"at_limit.bin": _KEPT_BYTES, "over_limit.bin": _KEPT_BYTES + 1}.items():
        with open(run_dir / name, "wb") as file:
            file.truncate(size)
    found = survey(run_dir, run_dir / "checkpoints")
    assert set(found.contents) == {"config.json", "metrics.jsonl", "at_limit.bin"}
    assert found.contents["config.json"] == b'{"a": 1}'
    assert found.sizes["logs/rank_0.log"] == len("first launch\n")
    assert found.sizes["over_limit.bin"] == _KEPT_BYTES + 1


def test_a_top_level_file_at_the_size_limit_is_put_back_byte_for_byte(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = bytes(range(256)) * (_KEPT_BYTES // 256)
    (run_dir / "big.bin").write_bytes(data)
    found = survey(run_dir, run_dir / "checkpoints")
    (run_dir / "big.bin").write_bytes(b"rewritten")
    restore_found(found, run_dir / "checkpoints")
    assert (run_dir / "big.bin").read_bytes() == data


def test_restoring_a_run_directory_never_made_is_a_no_op(tmp_path):
    found = survey(tmp_path / "new" / "run", tmp_path / "new" / "run" / "checkpoints")
    restore_found(found, tmp_path / "new" / "run" / "checkpoints")  # the start failed before making it
    assert list(tmp_path.iterdir()) == []


def test_overwrite_warns_where_the_old_run_went_and_a_failed_start_puts_it_back(tmp_path, caplog):
    config = toy(tmp_path)
    run_dir = Path(config.run_dir)
    earlier_run(run_dir)
    bytes_before, tree_before = file_hashes(run_dir), tree(run_dir)
    with caplog.at_level(logging.WARNING, logger="fntrain.run.open"):
        opened = open_run(config, Runtime(), Launch(moves_aside=True))
    opened.close()
    assert opened.aside is not None and file_hashes(opened.aside) == bytes_before
    warnings = [r.getMessage() for r in caplog.records if r.name == "fntrain.run.open"]
    assert warnings == [f"overwrite: the run in {config.run_dir} moved to {opened.aside}"]
    (run_dir / "checkpoints").mkdir()  # the new run's checkpoint root, made before the failure
    opened.undo()
    assert file_hashes(run_dir) == bytes_before and tree(run_dir) == tree_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing left aside


def test_the_ranks_log_file_names_its_rank_and_restart(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # the rank comes from the runtime, not the launcher's env
    config = toy(tmp_path)
    run_dir = Path(config.run_dir)
    opened = open_run(config, Runtime(rank=1, world_size=2), Launch(restart_count=3))
    logging.getLogger("fntrain.test").warning("a line from rank 1")
    opened.close()
    assert (
        opened.log_path == run_dir / "logs" / "rank_1.log" and not (run_dir / "logs" / "rank_0.log").exists()
    )
    text = rank_log(run_dir, 1)
    assert ", restart 3, log " in text and all(line.startswith("[rank 1] ") for line in text.splitlines())
    assert "a line from rank 1" in text


def test_which_launch_this_is_counts_up_on_rank_0_and_is_read_there_alone(tmp_path):
    config = toy(tmp_path)
    run_dir = Path(config.run_dir)
    attempts = []
    for _ in range(3):
        opened = open_run(config, Runtime(), Launch())
        opened.close()
        attempts.append(opened.attempt)
    assert attempts == [0, 1, 2]
    assert json.loads((run_dir / METADATA_FILE).read_text())["attempt"] == 2
    other = open_run(config, Runtime(rank=1, world_size=2), Launch())
    other.close()
    assert other.attempt == 0  # rank 1 does not read the file rank 0 may be writing


@pytest.mark.parametrize("complete", [False, True])
def test_a_launch_starts_committed_only_when_its_run_is_complete(tmp_path, complete):
    opened = open_run(toy(tmp_path), Runtime(), Launch(complete=complete))
    opened.close()
    assert opened.progress.committed is complete
    assert opened.progress.step is None and opened.progress.failed_at is None


def test_progress_commits_at_the_first_finished_step_and_names_the_step_a_failure_struck():
    progress = Progress()
    assert (progress.committed, progress.step, progress.failed_at) == (False, None, None)
    assert Progress(committed=True).committed is True
    progress(Event.STEP_END, TrainState(global_step=3), None)
    assert (progress.committed, progress.step) == (True, 3)
    progress(Event.ABORT, TrainState(global_step=3), RuntimeError("a step failed"))
    assert progress.failed_at == 4  # the step after the last finished one
    progress(Event.ABORT, TrainState(global_step=3), CheckpointSaveError("checkpoint step_3 failed", step=3))
    assert progress.failed_at == 3  # a failed save names its own step
