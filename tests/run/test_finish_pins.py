"""Behaviours of how a run ends (`fntrain.run.finish`) that mutation testing found unpinned
(mutation/RESULTS.md): the exact summary line for each ending, the exact one-line failure message (the
step, the error in a few words, where the traceback was kept), the traceback files (their content, a
second failure appended not overwritten, the per-rank file kept outside the run directory), the end
record the trackers and run_metadata.json get, what the export writes and its one-line failure, and
RunAborted. In process, on the tiny_gpt config of tests/run/test_launch.py: no model build, no device."""

from __future__ import annotations

import datetime
import json
import locale
import logging
import re
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from fntrain.checkpoint.export import ExportError
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.loop import TrainResult
from fntrain.run import finish
from fntrain.run.finish import (
    RunAborted,
    append_traceback,
    completed,
    export,
    failure_line,
    keep_traceback,
    record_end,
    resume_hint,
    summary_line,
    what_happened,
)
from fntrain.state import TrainState
from tests.run.test_launch import launch_config, write_checkpoint

MAIN = SimpleNamespace(is_main=True, rank=0)


@pytest.fixture
def ascii_locale():
    """A machine whose locale encoding is ASCII (LANG=C without UTF-8): a traceback file is UTF-8 anyway,
    so that a non-ASCII message (a path, a user's text) cannot make keeping the traceback fail."""
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


def failed(error: BaseException) -> BaseException:
    """`error` raised and caught, so that it carries a traceback through `a_failing_step`."""

    def a_failing_step():
        raise error

    try:
        a_failing_step()
    except BaseException as caught:  # noqa: BLE001 - handed back to the test
        return caught
    raise AssertionError("not raised")


def metrics(run, *records: dict) -> None:
    path = Path(run.run_dir) / run.metrics.jsonl_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"epoch": 0, "attempt": 0, **record}) + "\n" for record in records))


# ----------------------------------------------------------------------------- RunAborted, completed


def test_run_aborted_carries_its_line_and_exit_status():
    aborted = RunAborted("run failed at step 2: OSError: x; full traceback in /t.log")
    assert (str(aborted), aborted.line, aborted.exit_code) == (
        "run failed at step 2: OSError: x; full traceback in /t.log",
        "run failed at step 2: OSError: x; full traceback in /t.log",
        1,
    )
    assert RunAborted("run interrupted", 130).exit_code == 130


@pytest.mark.parametrize("outcome, done", [("completed", True), ("stopped", True), ("preempted", False),
                                           ("interrupted", False)])  # fmt: skip
def test_only_a_notice_makes_a_run_not_completed(outcome, done):
    assert completed(TrainResult(TrainState(), outcome)) is done


# ----------------------------------------------------------------------------- summary line


def test_the_summary_line_says_steps_tokens_time_losses_and_where_the_weights_went(tmp_path):
    """Its loss is the last metrics line's `loss` (not `loss_last`), said as the mean of the steps since
    the loss logged before it."""
    run = launch_config(tmp_path)
    metrics(run, {"step": 2, "loss": 3.0, "consumed_tokens": 500},
            {"step": 4, "val_loss": 2.25}, {"step": 6, "loss": 1.234567, "loss_last": 0.5, "consumed_tokens": 1234567, "val_loss": 2.5})  # fmt: skip
    line = summary_line(run, "completed", 6, 12.34, exported=["/w/hf_model", "/w/model.safetensors"],
                        ending="not shown when weights were written")  # fmt: skip
    assert line == ("run completed at step 6; 1,234,567 tokens; 12.3 s; loss 1.235 (mean of steps 3-6); "
                    "best val_loss 2.25 (step 4); weights in /w/hf_model, /w/model.safetensors")  # fmt: skip


def test_a_run_without_records_says_only_its_step_time_and_ending(tmp_path):
    run = launch_config(tmp_path)
    assert summary_line(run, "stopped", None, 0.04, ending="no checkpoint was saved") == (
        "run stopped before its first step; 0.0 s; no checkpoint was saved"
    )
    assert summary_line(run, "completed", 3, 1.0) == "run completed at step 3; 1.0 s"
    metrics(run, {"step": 1, "loss": 2.0})
    assert summary_line(run, "preempted", 1, 2.0, ending="run the same command again") == (
        "run preempted at step 1; 2.0 s; loss 2 (step 1); run the same command again"
    )


def test_the_hint_after_an_explicit_restore_from_latest_is_to_run_again(tmp_path):
    write_checkpoint(launch_config(tmp_path), 4)
    assert (
        resume_hint(launch_config(tmp_path, restore_from="latest"))
        == "run the same command again to resume from step_4"
    )


# ----------------------------------------------------------------------------- failure line and tracebacks


def test_what_happened_is_the_type_and_the_first_line_of_the_message():
    assert what_happened(ValueError("  bad shard\nsecond line  ")) == "ValueError: bad shard"
    assert what_happened(ValueError("   ")) == "ValueError"
    assert what_happened(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_the_failure_line_names_the_step_the_error_and_the_traceback_file():
    error = OSError("sample 5: read error\nmore")
    assert failure_line(error, 2, Path("/runs/a/train.log")) == (
        "run failed at step 2: OSError: sample 5: read error; full traceback in /runs/a/train.log"
    )
    assert (
        failure_line(error, 0, "/t.log")
        == "run failed at step 0: OSError: sample 5: read error; full traceback in /t.log"
    )
    assert failure_line(RuntimeError(), None, "/tmp/f.log") == (
        "run failed before its first step: RuntimeError; full traceback in /tmp/f.log"
    )


def test_an_export_failure_line_is_the_exports_own_with_its_step():
    error = ExportError("exporting hf_model: OSError: disk full; the export was not written", 6)
    assert failure_line(error, None, "/t.log") == (
        "run failed at step 6 exporting hf_model: OSError: disk full; the export was not written; full traceback in /t.log"
    )


def assert_traceback(text: str, message: str) -> None:
    """A full traceback: the header, the frame that raised, the error's line (with non-ASCII kept)."""
    assert text.startswith("Traceback (most recent call last):\n"), text
    assert ", in a_failing_step\n" in text and "XX" not in text, text
    assert text.endswith(f"\nValueError: {message}\n"), text


def test_a_failure_is_appended_to_the_log_after_what_was_there(tmp_path, ascii_locale):
    log_file = tmp_path / "train.log"
    log_file.write_text("step 1 loss 2.0\n", encoding="utf-8")
    append_traceback(log_file, failed(ValueError("first — ü")))
    append_traceback(log_file, failed(ValueError("second")))
    text = log_file.read_text(encoding="utf-8")
    head, first, second = text.split("Traceback (most recent call last):\n")
    assert head == "step 1 loss 2.0\n"
    assert_traceback("Traceback (most recent call last):\n" + first, "first — ü")
    assert_traceback("Traceback (most recent call last):\n" + second, "second")


def test_a_traceback_kept_before_the_first_step_goes_to_a_stamped_per_rank_file(
    tmp_path, monkeypatch, ascii_locale
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    error = failed(ValueError("hook failed — ü"))
    kept = keep_traceback(error, 3)
    again = keep_traceback(error, 3)
    assert kept != again and kept.parent == again.parent == tmp_path
    match = re.fullmatch(r"fntrain-failed-(\d{8}-\d{6})-rank3-[^/]+\.log", kept.name)
    assert match, kept.name
    stamp = datetime.datetime.strptime(match.group(1), "%Y%m%d-%H%M%S")
    assert abs((datetime.datetime.now() - stamp).total_seconds()) < 120
    assert_traceback(kept.read_text(encoding="utf-8"), "hook failed — ü")


def test_the_traceback_of_a_chained_error_shows_its_cause(tmp_path):
    try:
        try:
            raise KeyError("shard")
        except KeyError as cause:
            raise ValueError("could not read") from cause
    except ValueError as error:
        append_traceback(tmp_path / "log", error)
    text = (tmp_path / "log").read_text(encoding="utf-8")
    assert (
        "KeyError: 'shard'" in text
        and "direct cause" in text
        and text.endswith("ValueError: could not read\n")
    )


# ----------------------------------------------------------------------------- the end record


class Tracker:
    """A metrics sink that keeps what it gets (a tracker's end-of-run summary)."""

    def __init__(self):
        self.summaries: list[dict] = []

    def write(self, step, record): ...

    def log_config(self, config, tags): ...

    def summary(self, values):
        self.summaries.append(dict(values))

    def close(self): ...


def metadata_file(run) -> Path:
    path = Path(run.run_dir) / "run_metadata.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    return path


@pytest.mark.parametrize("outcome, level", [("completed", logging.INFO), ("stopped", logging.INFO),
                                            ("preempted", logging.WARNING), ("failed", logging.WARNING)])  # fmt: skip
def test_the_end_is_logged_sent_to_the_trackers_and_noted_in_the_metadata(tmp_path, caplog, outcome, level):
    run = launch_config(tmp_path)
    path = metadata_file(run)
    tracker = Tracker()
    caplog.set_level(logging.INFO, logger="fntrain.run.job")
    record_end(run, MAIN, MetricsLog(enabled=True, sinks=[tracker]), outcome, "run ended; 100% done",
               time.monotonic() - 12.26, exported=["/w/hf_model", "/w/model.safetensors"])  # fmt: skip
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fntrain.run.job"] == [
        (level, "run ended; 100% done")
    ]
    assert tracker.summaries == [
        {"outcome": outcome, "wall_s": 12.3, "exported": "/w/hf_model, /w/model.safetensors"}
    ]
    metadata = json.loads(path.read_text())
    assert (metadata["outcome"], metadata["summary"], metadata["exported"]) == (
        outcome,
        "run ended; 100% done",
        ["/w/hf_model", "/w/model.safetensors"],
    )


def test_an_end_without_exports_or_metrics_log_still_reaches_the_metadata(tmp_path, caplog):
    run = launch_config(tmp_path)
    path = metadata_file(run)
    tracker = Tracker()
    record_end(run, MAIN, MetricsLog(enabled=True, sinks=[tracker]), "stopped", "s", time.monotonic())
    assert tracker.summaries[0]["exported"] == ""
    record_end(
        run, SimpleNamespace(is_main=False, rank=0), None, "failed before training", "t", time.monotonic()
    )
    assert "t" not in [r.getMessage() for r in caplog.records]
    assert json.loads(path.read_text())["outcome"] == "failed before training"


# ----------------------------------------------------------------------------- export


def built_run_for(run, model=None, pp_size: int = 1, group=None):
    mesh = SimpleNamespace(get_group=lambda name: {"pp": group}[name])
    run_dir = Path(run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(run_dir=run_dir, components=SimpleNamespace(model=model or torch.nn.Linear(2, 3)),
                           runtime=SimpleNamespace(pp_size=pp_size, mesh=mesh))  # fmt: skip


def test_export_writes_the_recipes_output_then_the_weights_with_the_train_state(tmp_path):
    run = launch_config(tmp_path)
    built, state = built_run_for(run), TrainState(1, 6, 2)
    called = []

    def recipe_export(*args):
        called.append(args)
        return tmp_path / "hf_model"

    assert export(run, recipe_export, built, state) == [
        str(tmp_path / "hf_model"),
        str(built.run_dir / "model.safetensors"),
    ]
    assert called == [(built, state)]
    with safe_open(str(built.run_dir / "model.safetensors"), "pt") as weights:
        assert json.loads(weights.metadata()["fntrain"]) == {"epoch": 1, "global_step": 6, "cursor": 2}
        assert torch.equal(weights.get_tensor("weight"), built.components.model.weight.detach())


def test_export_lists_only_what_was_written(tmp_path):
    run = launch_config(tmp_path, export=False)
    built = built_run_for(run)
    assert export(run, lambda built, state: None, built, TrainState()) == []
    assert export(run, None, built, TrainState()) == []
    assert not (built.run_dir / "model.safetensors").exists()
    assert export(launch_config(tmp_path), None, built, TrainState()) == [str(built.run_dir / "model.safetensors")]


def test_export_under_pipeline_parallelism_gathers_over_the_pipeline_group(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(finish, "export_safetensors", lambda *args, **kwargs: calls.append((args, kwargs)))
    run, group = launch_config(tmp_path), object()
    built = built_run_for(run, pp_size=2, group=group)
    export(run, None, built, TrainState(0, 3, 3))
    assert calls == [((built.components.model, built.run_dir / "model.safetensors"),
                      {"metadata": {"epoch": 0, "global_step": 3, "cursor": 3}, "pipeline_group": group})]  # fmt: skip


def test_an_export_failure_is_one_line_saying_what_is_kept(tmp_path):
    run = launch_config(tmp_path)
    write_checkpoint(run, 4)
    cause = OSError("disk full")

    def recipe_export(built, state):
        raise cause

    with pytest.raises(ExportError) as caught:
        export(run, recipe_export, built_run_for(run), TrainState(0, 6, 6))
    assert (caught.value.line, caught.value.step, caught.value.__cause__) == (
        "exporting the model: OSError: disk full; the checkpoints (newest step_4, 2 steps before the run's end) "
        "are kept, the export was not written", 6, cause)  # fmt: skip
    assert not (Path(run.run_dir) / "model.safetensors").exists()
