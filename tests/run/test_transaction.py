"""The run as a transaction (fntrain/run/open.py, job.py, finish.py): a failure before the first
finished step leaves the run directory exactly as it was found; a failure after it records the outcome,
keeps the last good checkpoint and ends in one line naming the step and the log."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fntrain import Event
from fntrain.cli import run_recipe
from fntrain.run.config import CheckpointConfig
from fntrain.run.job import RunAborted, run_job
from fntrain.run.open import Found, restore_found, survey
from tests.helpers.files import file_hashes
from tests.run.test_job import spec, toy, toy_datasets


class BreaksAt:
    """A dataset whose sample `index` cannot be read (a file that breaks mid-run)."""

    def __init__(self, samples: list, index: int):
        self.samples, self.index = samples, index

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        if index == self.index:
            raise OSError(f"sample {index}: read error")
        return self.samples[index]


def breaking_spec(index: int):
    def datasets(config, assets):
        train, val = toy_datasets(config, assets)
        return BreaksAt(train, index), val

    return dataclasses.replace(spec, build_datasets=datasets)


def failing_hook(event_to_fail: Event):
    def hooks(built):
        def hook(event, state, info):
            if event is event_to_fail:
                raise RuntimeError(f"hook failed at {event.name}")

        return [hook]

    return hooks


def test_a_failure_mid_run_records_the_outcome_and_keeps_the_last_good_checkpoint(tmp_path):
    config = toy(tmp_path, loader=dataclasses.replace(toy(tmp_path).loader, shuffle=False),
                 checkpoint=CheckpointConfig(save_every=1))  # fmt: skip
    with pytest.raises(RunAborted) as aborted:
        run_job(config, breaking_spec(index=5))  # step 2 reads samples 4..7 (4 per step, no shuffle)
    line = aborted.value.line
    assert aborted.value.exit_code == 1 and isinstance(aborted.value.__cause__, OSError)
    log = tmp_path / "run" / "logs" / "rank_0.log"
    assert line == f"run failed at step 2: OSError: sample 5: read error; full traceback in {log}"
    assert "Traceback" in log.read_text() and "sample 5: read error" in log.read_text()
    metadata = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert metadata["outcome"] == "failed" and metadata["failed_at"] == 2 and metadata["summary"] == line
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_1"]
    assert (checkpoints / "latest").read_text().strip().endswith("step_1")


def test_the_cli_prints_the_one_line_and_exits_1(tmp_path, capsys):
    config = toy(tmp_path, loader=dataclasses.replace(toy(tmp_path).loader, shuffle=False))
    with pytest.raises(SystemExit) as exited:
        run_recipe(breaking_spec(index=5), config)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 1 and err[-1].startswith("run failed at step 2: OSError: sample 5")
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("event", [Event.TRAIN_BEGIN, Event.STEP_BEGIN])
def test_a_failure_before_the_first_step_removes_a_new_run_directory(tmp_path, event):
    with pytest.raises(RunAborted) as aborted:
        run_job(toy(tmp_path), dataclasses.replace(spec, hooks=failing_hook(event)))
    assert not (tmp_path / "run").exists()
    line = aborted.value.line
    assert line.startswith(f"run failed before its first step: RuntimeError: hook failed at {event.name}; full traceback in ")
    kept = Path(line.split("full traceback in ", 1)[1].split(";", 1)[0])
    assert f"hook failed at {event.name}" in kept.read_text()
    kept.unlink()


def test_a_failure_before_the_first_step_of_a_resume_leaves_the_run_as_it_was(tmp_path):
    config = toy(tmp_path, checkpoint=CheckpointConfig(save_every=2))
    run_job(config, spec)
    before = file_hashes(tmp_path / "run")
    longer = dataclasses.replace(
        config, train=dataclasses.replace(config.train, train_iters=6),
        checkpoint=CheckpointConfig(save_every=2, restore_from="latest", allow_changes=("train.train_iters",)),
    )  # fmt: skip
    with pytest.raises(RunAborted):
        run_job(longer, dataclasses.replace(spec, hooks=failing_hook(Event.STEP_BEGIN)))
    assert file_hashes(tmp_path / "run") == before
    assert run_job(longer, spec).state.global_step == 6  # the corrected command just works


def test_overwrite_that_fails_before_its_first_step_puts_the_old_run_back(tmp_path):
    config = toy(tmp_path)
    run_job(config, spec)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(RunAborted):
        run_job(dataclasses.replace(config, overwrite=True), dataclasses.replace(spec, hooks=failing_hook(Event.TRAIN_BEGIN)))
    assert file_hashes(tmp_path / "run") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing left aside


def test_ctrl_c_before_the_first_step_is_status_130_and_leaves_nothing(tmp_path):
    def interrupt(built):
        def hook(event, state, info):
            if event is Event.TRAIN_BEGIN:
                raise KeyboardInterrupt

        return [hook]

    with pytest.raises(RunAborted) as aborted:
        run_job(toy(tmp_path), dataclasses.replace(spec, hooks=interrupt))
    assert aborted.value.exit_code == 130 and "before its first step" in aborted.value.line
    assert not (tmp_path / "run").exists()


def test_restore_found_undoes_new_files_rewrites_and_appends(tmp_path):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.json").write_text('{"a": 1}')
    (run_dir / "logs" / "rank_0.log").write_text("first launch\n")
    (checkpoints / "step_2").mkdir(parents=True)
    found = survey(run_dir, checkpoints)
    (run_dir / "config.json").write_text('{"a": 2}')
    with open(run_dir / "logs" / "rank_0.log", "a") as log:
        log.write("second launch\n")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events").write_text("x")
    (run_dir / "run_metadata.json").write_text("{}")
    (checkpoints / "step_2" / "kept").write_text("checkpoints are never touched")
    restore_found(found, checkpoints)
    assert (run_dir / "config.json").read_text() == '{"a": 1}'
    assert (run_dir / "logs" / "rank_0.log").read_text() == "first launch\n"
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "run_metadata.json").exists()
    assert (checkpoints / "step_2" / "kept").exists()


def test_restore_found_of_a_new_directory_removes_what_was_created(tmp_path):
    found = survey(tmp_path / "a" / "b" / "run", tmp_path / "a" / "b" / "run" / "checkpoints")
    assert found == Found(tmp_path / "a" / "b" / "run", tmp_path / "a")
    (tmp_path / "a" / "b" / "run" / "logs").mkdir(parents=True)
    restore_found(found, tmp_path / "a" / "b" / "run" / "checkpoints")
    assert not (tmp_path / "a").exists()
