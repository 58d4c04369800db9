"""Behaviours of the run launch (`fntrain.run.launch`) that mutation testing found unpinned
(mutation/RESULTS.md): the whole Launch record each way a launch goes (its restart count included), the
exact one-line errors a refused launch gives, the warning lines an allowed change gives in phase 1 and
phase 2, phase 2's fallback over real checkpoints, and what `restore_launch` puts back into a built run.
In process, over hand-made and toy checkpoints: no model build, no device."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fntrain.checkpoint import SaveTarget, save
from fntrain.checkpoint import restorer as restorer_module
from fntrain.checkpoint.verify import CheckpointDamagedError
from fntrain.config import ConfigError
from fntrain.hooks.base import stateful
from fntrain.run import launch as launching
from fntrain.run.launch import Launch, decide_launch, restore_launch, verify_launch
from fntrain.state import TrainState
from recipes import tiny_gpt
from tests.checkpoint import toy
from tests.run.test_launch import launch_config, write_checkpoint

DATA = "__0_0.distcp"  # the toy checkpoint's one DCP data file
HINT = '; restore another checkpoint ("latest" skips damaged ones)'
ASIDE = r"\.replaced-\d{8}-\d{6}"  # aside_name's stamp


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fntrain.run.launch" and r.levelno == logging.WARNING
    ]


def real_checkpoint(
    run: tiny_gpt.Config, step: int, *, data: dict | None = None, hooks=(), parts=None, **changed
):
    """A real toy checkpoint `step_<step>` in `run`'s checkpoint root whose meta.json records `run`'s
    settings (with `changed` top-level fields replaced) and the data fingerprint `data`."""
    saved = launching.config_to_dict(dataclasses.replace(run, **changed))
    target = SaveTarget(Path(run.run_dir) / "checkpoints", parts or toy.components(), hooks=hooks, config=saved,
                        data=data)  # fmt: skip
    return save(target, TrainState(0, step, step))


def flip_a_byte(path: Path) -> None:
    """Damage that keeps every size: only reading the contents finds it."""
    blob = bytearray((path / DATA).read_bytes())
    blob[-1] ^= 0xFF
    (path / DATA).write_bytes(bytes(blob))


def test_every_launch_record_keeps_the_restart_it_was_decided_for(tmp_path):
    never = launch_config(tmp_path, restore_from="none")
    assert decide_launch(never, 2) == Launch(2)
    auto = launch_config(tmp_path)  # nothing in the run directory yet
    assert decide_launch(auto, 2, train_iters=6) == Launch(2, "auto")
    run_dir = Path(auto.run_dir)
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(launching.config_to_dict(auto)))
    assert decide_launch(auto, 2, train_iters=6) == Launch(2, "auto")  # again in place
    step = write_checkpoint(auto, 3)
    assert decide_launch(auto, 2, train_iters=6) == Launch(2, "auto", step, {}, False, False)


def test_a_second_run_is_refused_in_one_line_naming_what_the_directory_holds(tmp_path):
    run = launch_config(tmp_path, restore_from="none")
    write_checkpoint(run, 3)
    (Path(run.run_dir) / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as raised:
        decide_launch(run, 0)
    assert re.fullmatch(
        re.escape(f"run_dir {run.run_dir!r} already holds a run ('config.json', 'checkpoints/'): resume it with "
                  "checkpoint.restore_from auto (its newest checkpoint is step_3), or start over with `overwrite`, "
                  f"which moves the old run to '{run.run_dir}") + ASIDE + "'",
        str(raised.value),
    )  # fmt: skip


def test_a_rerun_in_place_with_other_settings_is_refused_in_one_line(tmp_path):
    run = launch_config(tmp_path)
    Path(run.run_dir).mkdir()
    (Path(run.run_dir) / "config.json").write_text(json.dumps(launching.config_to_dict(run)))
    with pytest.raises(ConfigError) as raised:
        decide_launch(dataclasses.replace(run, seed=7), 0, train_iters=6)
    assert re.fullmatch(
        re.escape(f"run_dir {run.run_dir!r} holds a run (no complete checkpoint yet) with other settings: `seed` "
                  "42 -> 7; rerun with the same settings, name each field in checkpoint.allow_changes, or start "
                  f"a new run: `overwrite` (which moves the old run to '{run.run_dir}") + ASIDE +
        re.escape("') or another `run_dir`"),
        str(raised.value),
    )  # fmt: skip


@pytest.mark.parametrize("written", ["[1, 2]", "not json {", '"a string"'])
def test_a_config_json_that_is_not_a_config_is_not_compared(tmp_path, written):
    run = launch_config(tmp_path)
    Path(run.run_dir).mkdir()
    (Path(run.run_dir) / "config.json").write_text(written)
    assert decide_launch(dataclasses.replace(run, seed=7), 0, train_iters=6) == Launch(0, "auto")


def test_changed_settings_are_listed_each_in_one_line_naming_the_checkpoint(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    step = write_checkpoint(run, 2, seed=7, log_every=1, train=dataclasses.replace(run.train, micro_batch_size=8))
    with pytest.raises(ConfigError) as raised:
        decide_launch(run, 0, train_iters=6)
    assert str(raised.value).startswith(
        f"checkpoint.restore_from {str(step)!r} belongs to a run with other settings: `seed` 7 -> 42; "
        "`train.micro_batch_size` 8 -> 16; resume with the same settings, or name each field in "
        f"checkpoint.allow_changes; for a new run: `overwrite` (which moves this one to '{run.run_dir}"
    ) and str(raised.value).endswith("') or another `run_dir`")  # log_every is free: never listed
    assert launching._resume_ways_out(run, str(step)).endswith(  # a named checkpoint: a new run takes its weights
        "checkpoint.allow_changes; for a new run from its weights: checkpoint.weights_only"
    )


def test_allow_changes_takes_fields_as_written_on_the_command_line(tmp_path):
    run = launch_config(tmp_path, restore_from="latest", allow_changes=("train.micro-batch-size",))
    write_checkpoint(run, 2, train=dataclasses.replace(run.train, micro_batch_size=8))
    launch = decide_launch(run, 0, train_iters=6)
    assert launch.changes == {"train.micro_batch_size": [8, 16]}


@dataclasses.dataclass(frozen=True)
class DataByPath(tiny_gpt.Config):
    """A recipe whose data is one setting (a path), not a section."""

    data: str = "corpus.txt"  # type: ignore[assignment]


def test_allowing_data_lets_the_data_change_not_a_setting_named_data(tmp_path):
    base = DataByPath()
    run = dataclasses.replace(base, run_dir=str(tmp_path / "run"),
                              checkpoint=dataclasses.replace(base.checkpoint, allow_changes=("data",)))  # fmt: skip
    write_checkpoint(run, 2, data={"dataset": {"samples": 10}})
    meta_path = Path(run.run_dir) / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["data"] = "other.txt"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"other settings: `data` 'other.txt' -> 'corpus.txt'; resume with"):
        decide_launch(run, 0, fingerprint={"dataset": {"samples": 11}}, train_iters=6)


def test_changed_data_is_refused_in_one_line_listing_every_change(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    step = write_checkpoint(run, 2, data={"dataset": {"samples": 10, "tokens": 5}})
    with pytest.raises(ConfigError) as raised:
        decide_launch(run, 0, fingerprint={"dataset": {"samples": 11, "tokens": 6}}, train_iters=6)
    assert str(raised.value) == (
        f"checkpoint.restore_from {str(step)!r} was saved with other data: samples 10 -> 11; tokens 5 -> 6; "
        "resume with the same data, or add data to checkpoint.allow_changes"
    )


def test_allowed_changed_data_is_one_warning_and_a_change_from_the_saved_summary_to_the_new(tmp_path, caplog):
    """Phase 1 decides and says nothing; the launch holds the one warning (each changed fact) that
    phase 2 logs."""
    run = launch_config(tmp_path, restore_from="latest", allow_changes=("data",))
    write_checkpoint(run, 2, data={"dataset": {"samples": 10, "tokens": 5}})
    launch = decide_launch(run, 0, fingerprint={"dataset": {"samples": 11, "tokens": 6}}, train_iters=6)
    old, new = launch.changes["data"]
    assert old.startswith("0 files, 10 samples (digest ") and new.startswith("0 files, 11 samples (digest ")
    assert old != new
    assert launch.said == (
        "resuming with changed data (checkpoint.allow_changes data): samples 10 -> 11; tokens 5 -> 6",
    )
    assert warnings_of(caplog) == []


def test_a_checkpoint_saved_before_fingerprints_resumes_any_data(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    step = write_checkpoint(run, 2, data=None)
    launch = decide_launch(run, 0, fingerprint={"dataset": {"samples": 11}}, train_iters=6)
    assert launch == Launch(0, "latest", step, {}, False, False)


def test_a_run_is_complete_only_once_its_checkpoint_reached_a_known_last_step(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    write_checkpoint(run, 1)
    assert decide_launch(run, 0, train_iters=1).kind == "complete"  # a one-step run
    assert decide_launch(run, 0, train_iters=2).kind == "resume"
    assert decide_launch(run, 0, train_iters=0).kind == "resume"  # no known length: never complete
    assert decide_launch(run, 0, train_iters=None).kind == "resume"
    meta = Path(run.run_dir) / "checkpoints" / "step_1" / "meta.json"
    meta.write_text("not json")  # unreadable: phase 2 says why; it is not taken as complete
    assert decide_launch(run, 0, train_iters=1).kind == "resume"


def test_a_named_checkpoint_is_checked_by_its_sizes_in_phase_one_and_its_contents_in_phase_two(tmp_path):
    other = launch_config(tmp_path / "other")
    step = real_checkpoint(other, 4)
    run = launch_config(tmp_path, restore_from=str(step))
    decided = decide_launch(run, 0, train_iters=8)
    assert decided == Launch(0, str(step), step, {}, False, False)
    flip_a_byte(step)  # same size: phase 1 (files alone, no process group) cannot tell
    assert decide_launch(run, 0, train_iters=8) == decided
    with pytest.raises(CheckpointDamagedError) as raised:
        verify_launch(run, decided, train_iters=8)
    assert str(raised.value).startswith(f"damaged checkpoint: {step / DATA}: ")
    blob = (step / DATA).read_bytes()
    (step / DATA).write_bytes(blob[: len(blob) // 2])  # cut short: phase 1 refuses it by name
    with pytest.raises(CheckpointDamagedError) as raised:
        decide_launch(run, 0, train_iters=8)
    message = str(raised.value)
    assert message.startswith(f"damaged checkpoint: {step / DATA}: ") and message.endswith(HINT)
    assert message.count(HINT) == 1 and "None" not in message


def test_phase_two_decides_a_fallback_by_the_same_rules_for_the_same_restart(tmp_path, caplog):
    """The newest checkpoint is complete at the run's end but damaged inside: phase 2 falls back to the
    older one, a resume of the same restart with that checkpoint's setting and data changes."""
    run = launch_config(tmp_path, restore_from="latest", allow_changes=("seed", "data"))
    now = {"dataset": {"samples": 11}}
    older = real_checkpoint(run, 2, data={"dataset": {"samples": 10}}, seed=7)
    newest = real_checkpoint(run, 6, data=now)
    decided = decide_launch(run, 1, fingerprint=now, train_iters=6)
    assert decided == Launch(1, "latest", newest, {}, False, True)
    flip_a_byte(newest)
    caplog.clear()
    verified = verify_launch(run, decided, fingerprint=now, train_iters=6)
    data = verified.changes.pop("data")
    said = (
        "resuming with seed changed from 7 to 42 (checkpoint.allow_changes)",
        "resuming with changed data (checkpoint.allow_changes data): samples 10 -> 11",
    )  # the data change is said once, file by file
    assert verified == Launch(1, "latest", older, {"seed": [7, 42]}, False, False, said)
    assert data[0].startswith("0 files, 10 samples") and data[1].startswith("0 files, 11 samples")
    assert warnings_of(caplog) == list(said)


def test_phase_two_fallback_to_a_checkpoint_at_the_last_step_is_complete(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    at_end = real_checkpoint(run, 6)
    beyond = real_checkpoint(run, 8)
    decided = decide_launch(run, 0, train_iters=6)
    assert decided.path == beyond
    flip_a_byte(beyond)
    assert verify_launch(run, decided, train_iters=6) == Launch(0, "latest", at_end, {}, False, True)


def test_a_named_checkpoint_root_resolves_to_its_newest_and_an_overwrite_still_moves_the_old_run(tmp_path):
    other = launch_config(tmp_path / "other")
    root = Path(other.run_dir) / "checkpoints"
    real_checkpoint(other, 2)
    newest = real_checkpoint(other, 4)
    run = launch_config(tmp_path, overwrite=True, restore_from=str(root))
    write_checkpoint(run, 1)  # the old run in run_dir
    decided = decide_launch(run, 0, train_iters=8)
    assert decided == Launch(0, str(root), root, {}, True, False)
    assert verify_launch(run, decided, train_iters=8) == Launch(0, str(root), newest, {}, True, False)


def test_an_allowed_change_is_one_warning_a_line_resuming_or_starting_again(tmp_path, caplog):
    run = launch_config(tmp_path, allow_changes=("seed",))
    Path(run.run_dir).mkdir()
    (Path(run.run_dir) / "config.json").write_text(json.dumps(launching.config_to_dict(run)))
    again = dataclasses.replace(run, seed=7)
    decided = decide_launch(again, 0, train_iters=6)
    said = ("starting the run again with seed changed from 42 to 7 (checkpoint.allow_changes)",)
    assert decided == Launch(0, "auto", changes={"seed": [42, 7]}, said=said)
    assert warnings_of(caplog) == []  # phase 1 says nothing: phase 2 says each change once
    assert verify_launch(again, decided, train_iters=6) == decided
    assert warnings_of(caplog) == list(said)
    step = real_checkpoint(run, 2, seed=5)
    decided = decide_launch(again, 0, train_iters=6)
    caplog.clear()
    said = ("resuming with seed changed from 5 to 7 (checkpoint.allow_changes)",)
    assert verify_launch(again, decided, train_iters=6) == Launch(0, "auto", step, {"seed": [5, 7]}, False, False, said)
    assert warnings_of(caplog) == list(said)


def built(parts, *, pp_size: int = 1, device: str = "cpu") -> SimpleNamespace:
    """What restore_launch reads of a built run: its components and its runtime's device and pp size."""
    return SimpleNamespace(
        components=parts, runtime=SimpleNamespace(device=torch.device(device), pp_size=pp_size)
    )


def test_restore_launch_puts_back_the_checkpoint_and_the_hooks_states(tmp_path, monkeypatch):
    run = launch_config(tmp_path)
    box = {"n": 7}
    hook = stateful("counter", lambda *a: None, lambda: dict(box), lambda s: box.update(s))
    parts = toy.components()
    toy.step(parts, toy.batches(1)[0])
    step = real_checkpoint(run, 3, hooks=[hook], parts=parts)
    box["n"] = 0
    fresh = toy.components(seed=5)
    assert restore_launch(run, Launch(source="auto"), built(fresh), [hook]) == TrainState()
    assert not toy.same_weights(fresh, parts) and box == {"n": 0}  # nothing to continue: nothing touched
    launch = verify_launch(run, decide_launch(run, 0, train_iters=6), train_iters=6)
    assert launch.path == step
    # phase 2 verified it: the restore reads it once, without verifying it again
    monkeypatch.setattr(restorer_module, "resolve_source", lambda *a, **k: pytest.fail("verified twice"))
    assert restore_launch(run, launch, built(fresh), [hook]) == TrainState(0, 3, 3)
    assert toy.same_weights(fresh, parts) and fresh.optimizers[0].state and box == {"n": 7}


def test_restore_launch_of_a_weights_only_run_starts_at_step_zero(tmp_path):
    run = launch_config(tmp_path, weights_only=True)
    parts = toy.components()
    toy.step(parts, toy.batches(1)[0])
    step = real_checkpoint(run, 3, parts=parts)
    fresh = toy.components(seed=5)
    assert restore_launch(run, Launch(0, "auto", step), built(fresh), []) == TrainState()
    assert toy.same_weights(fresh, parts) and not fresh.optimizers[0].state


def test_restore_launch_restores_the_rng_onto_the_runtimes_device(tmp_path, monkeypatch):
    """Not the device the model's parameters sit on (CPU for an offloaded model)."""
    run = launch_config(tmp_path)
    step = real_checkpoint(run, 3)
    onto = []
    real = restorer_module.set_rng_state
    monkeypatch.setattr(
        restorer_module, "set_rng_state", lambda state, device: (onto.append(device), real(state, "cpu"))
    )
    restore_launch(run, Launch(0, "auto", step), built(toy.components(), device="meta"), [])
    assert onto == [torch.device("meta")]


def test_restore_launch_of_a_pipeline_stage_takes_its_part_of_the_checkpoint_quietly(tmp_path, caplog):
    run = launch_config(tmp_path)
    step = real_checkpoint(run, 3, parts=toy.components(extra=True, optimizer=False))
    extra = f"checkpoint {step} has model keys the model does not: extra.bias, extra.weight (ignored)"
    for pp_size, warned in ((1, [extra]), (2, [])):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
            restore_launch(
                run, Launch(0, "auto", step), built(toy.components(optimizer=False), pp_size=pp_size), []
            )
        assert [r.getMessage() for r in caplog.records if "model keys" in r.getMessage()] == warned
