"""What a launch is, decided in one function from the files alone (`fntrain.run.launch`): fresh, resume,
overwrite or complete; a second run into a directory refused; a torchrun restart keeping the run its
first launch began; phase 2's fallback decided again by the same rules. Plain calls over hand-made
checkpoint directories: no model, no device, no run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fntrain.checkpoint.layout import DCP_METADATA, MARKER
from fntrain.config import ConfigError
from fntrain.run import launch as launching
from fntrain.run.launch import Launch, decide_launch, verify_launch
from recipes import tiny_gpt

FORMAT = 1  # fntrain.checkpoint's meta.json format


def launch_config(tmp_path: Path, *, overwrite: bool = False, **checkpoint) -> tiny_gpt.Config:
    base = tiny_gpt.Config()
    return dataclasses.replace(base, run_dir=str(tmp_path / "run"), overwrite=overwrite,
                               checkpoint=dataclasses.replace(base.checkpoint, **checkpoint))  # fmt: skip


def write_checkpoint(run: tiny_gpt.Config, step: int, *, data: dict | None = None, **changed) -> Path:
    """A complete-looking checkpoint `step_<step>` of `run` (its meta.json records `run`'s settings,
    with `changed` top-level fields replaced)."""
    path = Path(run.run_dir) / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(b"")
    (path / MARKER).write_text("{}")
    saved = launching.config_to_dict(dataclasses.replace(run, **changed))
    meta = {"format": FORMAT, "config": saved, "train_state": {"epoch": 0, "global_step": step, "cursor": step},
            "data": data}  # fmt: skip
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_an_empty_run_directory_is_a_fresh_launch(tmp_path):
    for source in ("none", "latest", "auto"):
        launch = decide_launch(launch_config(tmp_path, restore_from=source), 0, train_iters=6)
        assert launch.kind == "fresh" and launch.path is None and not launch.moves_aside
        assert launch.resumes == (source != "none")


def test_a_rerun_resumes_its_newest_checkpoint_by_default(tmp_path):
    run = launch_config(tmp_path)  # the recipe's default: restore_from auto
    step = write_checkpoint(run, 100)
    (Path(run.run_dir) / "config.json").write_text("{}")
    assert decide_launch(run, 0, train_iters=400).path == step
    assert decide_launch(run, 0, train_iters=100).kind == "complete"


def test_a_second_run_into_a_directory_is_refused_naming_only_the_ways_out_that_work(tmp_path):
    run = launch_config(tmp_path)
    Path(run.run_dir).mkdir()
    (Path(run.run_dir) / "config.json").write_text("{}")
    # auto with nothing to resume yet (killed before its first save): the run starts again in place
    assert decide_launch(run, 0).kind == "fresh" and decide_launch(run, 1).kind == "fresh"
    never = launch_config(tmp_path, restore_from="none")
    with pytest.raises(ConfigError, match=r"already holds a run \('config.json'\) with no complete checkpoint to "
                                          r"resume: start over with `overwrite`"):  # fmt: skip
        decide_launch(never, 0)
    write_checkpoint(run, 3)
    with pytest.raises(ConfigError, match=r"already holds a run .*: resume it with checkpoint.restore_from auto "
                                          r"\(its newest checkpoint is step_3\), or start over with `overwrite`"):  # fmt: skip
        decide_launch(never, 0)


def test_a_run_killed_before_its_first_save_starts_again_in_place_only_with_its_settings(tmp_path):
    run = launch_config(tmp_path)  # restore_from auto, the default; no complete checkpoint yet
    Path(run.run_dir).mkdir()
    (Path(run.run_dir) / "config.json").write_text(json.dumps(launching.config_to_dict(run)))
    for again in (run, launch_config(tmp_path, restore_from="latest"), dataclasses.replace(run, log_every=3)):
        launch = decide_launch(again, 0, train_iters=6)
        assert (launch.kind, launch.path, launch.moves_aside, launch.changes) == ("fresh", None, False, {})
        assert launch.resumes
    changed = dataclasses.replace(run, seed=7)
    with pytest.raises(ConfigError, match=r"run_dir '.*run' holds a run \(no complete checkpoint yet\) with other "
                                          r"settings: `seed` 42 -> 7; .*checkpoint.allow_changes.*`overwrite`"):  # fmt: skip
        decide_launch(changed, 0, train_iters=6)
    with pytest.raises(ConfigError, match="`seed` 42 -> 7"):
        decide_launch(changed, 1, train_iters=6)  # a torchrun restart is compared too
    allowed = dataclasses.replace(launch_config(tmp_path, allow_changes=("seed",)), seed=7)
    launch = decide_launch(allowed, 0, train_iters=6)
    assert (launch.kind, launch.path, launch.changes) == ("fresh", None, {"seed": [42, 7]})
    weights = dataclasses.replace(launch_config(tmp_path, weights_only=True), seed=7)  # a new run: anything goes
    assert decide_launch(weights, 0, train_iters=6).changes == {}
    over = dataclasses.replace(launch_config(tmp_path, overwrite=True), seed=7)  # the old run moves aside
    assert decide_launch(over, 0, train_iters=6).kind == "overwrite"


def test_latest_resumes_the_newest_checkpoint_and_knows_when_the_run_is_complete(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    write_checkpoint(run, 2)
    newest = write_checkpoint(run, 4)
    resumed = decide_launch(run, 0, train_iters=6)
    assert (resumed.kind, resumed.path, resumed.changes) == ("resume", newest, {})
    assert decide_launch(run, 0, train_iters=4).kind == "complete"


def test_overwrite_moves_the_old_run_aside_on_the_first_launch_only(tmp_path):
    run = launch_config(tmp_path, overwrite=True, restore_from="auto")
    step = write_checkpoint(run, 3)
    first = decide_launch(run, 0, train_iters=6)
    assert (first.kind, first.moves_aside, first.path, first.source) == ("overwrite", True, None, None)
    restarted = decide_launch(run, 1, train_iters=6)  # torchrun restarted this job: keep its run
    assert (restarted.kind, restarted.moves_aside, restarted.path) == ("resume", False, step)


def test_overwrite_into_an_empty_directory_moves_nothing(tmp_path):
    launch = decide_launch(launch_config(tmp_path, overwrite=True), 0)
    assert launch.kind == "fresh" and not launch.moves_aside


def test_a_named_checkpoint_is_restored_even_when_the_run_starts_over(tmp_path):
    other = launch_config(tmp_path / "other")
    step = write_checkpoint(other, 5)
    (step / MARKER).unlink()  # its files are phase 2's to verify: this one's are not real DCP files
    run = launch_config(tmp_path, overwrite=True, restore_from=str(step))
    launch = decide_launch(run, 0, train_iters=8)
    assert (launch.kind, launch.path) == ("resume", step)


def test_a_named_checkpoint_that_does_not_exist_is_a_setting_error(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint.restore_from '.*nowhere' does not exist"):
        decide_launch(launch_config(tmp_path, restore_from=str(tmp_path / "nowhere")), 0)


def test_changed_settings_are_refused_field_by_field_unless_allowed(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    write_checkpoint(run, 2, seed=7)
    with pytest.raises(ConfigError, match=r"other settings: `seed` 7 -> 42; .*allow_changes"):
        decide_launch(run, 0, train_iters=6)
    allowed = launch_config(tmp_path, restore_from="latest", allow_changes=("seed",))
    assert decide_launch(allowed, 0, train_iters=6).changes == {"seed": [7, 42]}
    weights = launch_config(tmp_path, restore_from="latest", weights_only=True)  # a new run: anything goes
    launch = decide_launch(weights, 0, train_iters=2)
    assert (launch.kind, launch.changes) == ("resume", {})


def test_changed_data_is_refused_unless_allowed(tmp_path):
    run = launch_config(tmp_path, restore_from="latest")
    saved = {"dataset": {"samples": 10}}
    write_checkpoint(run, 2, data=saved)
    now = {"dataset": {"samples": 11}}
    with pytest.raises(ConfigError, match="was saved with other data: samples 10 -> 11"):
        decide_launch(run, 0, fingerprint=now, train_iters=6)
    allowed = launch_config(tmp_path, restore_from="latest", allow_changes=("data",))
    assert set(decide_launch(allowed, 0, fingerprint=now, train_iters=6).changes) == {"data"}
    assert decide_launch(run, 0, fingerprint=saved, train_iters=6).changes == {}


def test_phase_two_falls_back_through_the_same_decision(tmp_path, monkeypatch):
    """The newest checkpoint is complete at the run's end; verified, it is damaged and the older one is
    used: that launch is a resume, with the older checkpoint's setting changes."""
    run = launch_config(tmp_path, restore_from="latest", allow_changes=("seed",))
    older = write_checkpoint(run, 2, seed=7)
    write_checkpoint(run, 6)
    decided = decide_launch(run, 0, train_iters=6)
    assert decided.kind == "complete"
    monkeypatch.setattr(launching, "resolve_source", lambda source, root: older)
    verified = verify_launch(run, decided, train_iters=6)
    assert (verified.kind, verified.path, verified.changes) == ("resume", older, {"seed": [7, 42]})
    monkeypatch.setattr(launching, "resolve_source", lambda source, root: decided.path)
    assert verify_launch(run, decided, train_iters=6) is decided


def test_a_launch_that_asks_for_nothing_is_not_verified(tmp_path, monkeypatch):
    monkeypatch.setattr(launching, "resolve_source", lambda *args: pytest.fail("verified a fresh launch"))
    assert verify_launch(launch_config(tmp_path), Launch(), train_iters=6) == Launch()


def test_requested_source_is_what_a_plan_and_a_launch_read_of_restore_from(tmp_path):
    assert launching.requested_source(launch_config(tmp_path, restore_from="none")) is None
    assert launching.requested_source(launch_config(tmp_path)) == "auto"
    over = launch_config(tmp_path, overwrite=True, restore_from="latest")
    assert launching.requested_source(over) is None  # starting over: the old checkpoints move aside
    assert launching.requested_source(over, restart_count=1) == "latest"
    named = launch_config(tmp_path, overwrite=True, restore_from="/some/step_4")
    assert launching.requested_source(named) == "/some/step_4"


def test_the_hint_after_an_early_stop_names_only_what_will_work(tmp_path):
    from fntrain.run.finish import resume_hint

    assert resume_hint(launch_config(tmp_path, save_every=0)) == (
        "no checkpoint was saved (set --checkpoint.save-every to make one)"
    )
    assert resume_hint(launch_config(tmp_path)) == (  # saving every 100 steps, stopped before step 100
        "no checkpoint was saved yet (--checkpoint.save-on-interrupt saves at a Ctrl-C)"
    )
    write_checkpoint(launch_config(tmp_path), 4)
    assert resume_hint(launch_config(tmp_path)) == "run the same command again to resume from step_4"
    assert resume_hint(launch_config(tmp_path, restore_from="none")) == (
        "resume from step_4 with --checkpoint.restore-from latest"
    )
    assert resume_hint(launch_config(tmp_path, overwrite=True)) == (
        "resume from step_4 with --checkpoint.restore-from latest and without --overwrite"
    )


def test_a_resume_compares_files_not_their_spellings(tmp_path, monkeypatch):
    from fntrain.run.resolved import recorded_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("To be, or not to be\n")
    (tmp_path / "other.txt").write_text("Something else\n")
    (tmp_path / "link.txt").symlink_to(tmp_path / "corpus.txt")
    run = launch_config(tmp_path)
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, path="corpus.txt"))
    step = write_checkpoint(run, 3)
    meta = json.loads((step / "meta.json").read_text())
    meta["config"] = recorded_config(run)  # as a run records it: the file by its absolute path
    assert meta["config"]["data"]["path"] == str(tmp_path / "corpus.txt")
    (step / "meta.json").write_text(json.dumps(meta))
    for spelling in ("corpus.txt", str(tmp_path / "corpus.txt"), "./corpus.txt", "link.txt"):
        again = dataclasses.replace(run, data=dataclasses.replace(run.data, path=spelling))
        assert decide_launch(again, 0, train_iters=6).changes == {}, spelling  # the same file: no change
    other = dataclasses.replace(run, data=dataclasses.replace(run.data, path="other.txt"))
    with pytest.raises(ConfigError, match=rf"`data.path` '{tmp_path}/corpus.txt' -> 'other.txt'"):
        decide_launch(other, 0, train_iters=6)  # another file, named as the user typed it
    allowed = dataclasses.replace(other, checkpoint=dataclasses.replace(other.checkpoint, allow_changes=("data.path",)))
    assert decide_launch(allowed, 0, train_iters=6).changes == {"data.path": [str(tmp_path / "corpus.txt"), "other.txt"]}


def test_a_recipe_is_the_same_whichever_package_or_spelling_recorded_it(tmp_path):
    """A checkpoint records `recipe_reference`: the installed package's or a checkout's module, or a
    file's resolved path. The same recipe compares equal however it was imported; another is named by
    the label a user types; a recorded file that is no longer there (moved) cannot be compared."""
    from fntrain.run.recipe_of import label_of, other_recipe, recipe_label

    assert [recipe_label(r) for r in ("fntrain_recipes.dpo", "recipes.tiny_gpt", "my.recipes.sft")] == [
        "dpo", "tiny_gpt", "my.recipes.sft"]  # fmt: skip
    assert label_of(tiny_gpt.Config) == "tiny_gpt"
    for same in ("fntrain_recipes.tiny_gpt", "recipes.tiny_gpt", "tiny_gpt", "tiny-gpt", None, ""):
        assert other_recipe(same, tiny_gpt.Config) is None, same
    assert other_recipe("fntrain_recipes.dpo", tiny_gpt.Config) == "dpo"
    recipe_file = tmp_path / "my_gpt.py"
    recipe_file.write_text("")
    assert other_recipe(str(recipe_file), tiny_gpt.Config) == str(recipe_file)
    assert other_recipe(str(tmp_path / "moved_away.py"), tiny_gpt.Config) is None
