"""A checkpoint save that fails: a full disk, a quota, an I/O error, at any file of the save, sync or
async; the free-space check before a save; what the hook does next (checkpoint.on_save_failure).

The full disk is a write shim (`full_disk`): every file opened for writing under the checkpoint root
whose name matches raises ENOSPC (or another errno) once its writes pass a byte budget, at the lowest
level both DCP (pathlib's open) and fntrain's JSON writes (builtins.open) go through. A simulated
capacity (`fake_disk_capacity`, tests/helpers/checkpoints.py) stands in for a small filesystem's free space. The same faults on a real
size-limited tmpfs are in tests/checkpoint/test_full_disk.py (slow tier)."""

from __future__ import annotations

import builtins
import dataclasses
import errno
import fnmatch
import io
import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from fntrain import StepInfo, TrainState
from fntrain.checkpoint import (
    CheckpointSaveError,
    SaveOptions,
    SaveTarget,
    find_latest,
    list_checkpoints,
    save,
    save_async,
    space,
    step_dir,
)
from fntrain.checkpoint.layout import LATEST
from fntrain.hooks import checkpoint_writes as checkpoint_module
from fntrain.hooks.checkpoint import checkpoint_hook, saves_at_end
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from tests.checkpoint import toy
from tests.helpers.checkpoints import bytes_under, fake_disk_capacity, saved_steps

INFO = StepInfo({"loss": 0.0})


class _FullFile:
    """A file whose writes fail with `code` once `budget` bytes were written."""

    def __init__(self, file, budget: int, code: int, shim: FullDisk):
        self._file, self._budget, self._code, self._shim = file, budget, code, shim

    def write(self, data):
        size = memoryview(data).nbytes if not isinstance(data, str) else len(data.encode())
        if size > self._budget:
            self._shim.failed.set()
            raise OSError(self._code, os.strerror(self._code), str(self._file.name))
        self._budget -= size
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
        return False

    def __iter__(self):
        return iter(self._file)

    def __getattr__(self, name):
        return getattr(self._file, name)


class FullDisk:
    """Patches builtins.open and io.open (pathlib's): files under `root` named like `pattern`, opened
    for writing, fail with `code` after `budget` bytes; `times` such files fail (then writes work)."""

    def __init__(self, monkeypatch, root: Path, pattern: str, *, budget: int = 0, code: int = errno.ENOSPC,
                 times: int = 1_000_000):  # fmt: skip
        self.root, self.pattern, self.budget, self.code, self.times = Path(root), pattern, budget, code, times
        self.failed = threading.Event()
        real = builtins.open

        def shimmed(file, mode="r", *args, **kwargs):
            handle = real(file, mode, *args, **kwargs)
            if any(flag in mode for flag in "wax") and self._matches(file) and self.times > 0:
                self.times -= 1
                return _FullFile(handle, self.budget, self.code, self)
            return handle

        monkeypatch.setattr(builtins, "open", shimmed)
        monkeypatch.setattr(io, "open", shimmed)

    def _matches(self, file) -> bool:
        if isinstance(file, int):
            return False
        path = Path(os.fsdecode(file)).absolute()
        return self.root.absolute() in path.parents and fnmatch.fnmatch(path.name, self.pattern)


def partial_step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and not p.name[5:].isdigit())


# ----------------------------------------------------------------------------- save / save_async


@pytest.mark.parametrize("pattern", ["*.distcp", ".metadata*", "*meta.json*", "*rank_0.json*",
                                     "*manifest.json*", "*COMPLETE*"])  # fmt: skip
def test_a_full_disk_at_any_file_of_a_save_is_one_line_and_loses_nothing(tmp_path, monkeypatch, pattern):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3))
    FullDisk(monkeypatch, tmp_path, pattern)
    with pytest.raises(CheckpointSaveError) as caught:
        save(SaveTarget(tmp_path, parts), TrainState(0, 6, 6))
    line = caught.value.line
    assert "\n" not in line and line.startswith("checkpoint step_6 not saved: ")
    assert "No space left on device" in line or "the filesystem is full" in line or "ENOSPC" in line, line
    assert " free" in line and f"step_3 is the newest good checkpoint in {tmp_path}" in line
    assert caught.value.step == 6
    assert not step_dir(tmp_path, 6).exists() and partial_step_dirs(tmp_path) == []  # no partial under any name
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3"]
    assert (tmp_path / LATEST).read_text().strip() == "step_3" and find_latest(tmp_path).name == "step_3"


@pytest.mark.parametrize(
    ("code", "name"), [(errno.EDQUOT, "EDQUOT"), (errno.EIO, "EIO"), (errno.EACCES, "EACCES")]
)
def test_other_write_errors_name_the_os_error(tmp_path, monkeypatch, code, name):
    parts = toy.components()
    FullDisk(monkeypatch, tmp_path, "*.distcp", code=code)
    with pytest.raises(CheckpointSaveError) as caught:
        save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert name in caught.value.line and os.strerror(code) in caught.value.line
    assert "no complete checkpoint exists yet" in caught.value.line
    assert not step_dir(tmp_path, 2).exists()


def test_the_os_error_is_found_under_dcp_and_a_partial_that_cannot_be_removed_moves_aside(
    tmp_path, monkeypatch
):
    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x.distcp")
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = error
    assert space.os_error(wrapped) is error
    assert space.what_failed(wrapped).startswith("ENOSPC No space left on device: x.distcp")

    partial = tmp_path / "step_4"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # e.g. a permission change
    assert space.discard_partial(partial) == "the partial step_4 was moved aside to step_4.failed"
    assert (tmp_path / "step_4.failed" / "__0_0.distcp").read_bytes() == b"partial"


def test_a_save_that_will_not_fit_is_refused_before_writing_anything(tmp_path, monkeypatch, caplog):
    parts = toy.components()
    first = save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3))
    one = bytes_under(first)
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 1.5))
    written: list[str] = []
    real = builtins.open
    monkeypatch.setattr(
        builtins,
        "open",
        lambda f, m="r", *a, **k: (written.append(str(f)) if "w" in m else None) or real(f, m, *a, **k),
    )
    with pytest.raises(CheckpointSaveError) as caught:
        save(SaveTarget(tmp_path, parts), TrainState(0, 6, 6))
    line = caught.value.line
    assert "ENOSPC not enough free space" in line and "step_6" in line
    assert f"needs ~{space.human_bytes(space.needed_bytes(tmp_path, {}))}" in line  # the previous save's size
    assert "nothing was left behind" in line and "step_3 is the newest good checkpoint" in line
    assert written == [] and not step_dir(tmp_path, 6).exists()


def test_a_nearly_full_disk_is_said_early(tmp_path, monkeypatch, caplog):
    parts = toy.components()
    one = bytes_under(save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3)))
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 2.6))  # room for this save, not for the one after it
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 6, 6))
    assert (
        "checkpoint filesystem nearly full" in caplog.text and "the save after it will not fit" in caplog.text
    )


def test_needed_bytes_counts_the_state_before_the_first_save(tmp_path):
    parts = toy.components()
    from fntrain.checkpoint.saver import app_state
    from fntrain.checkpoint.tree import split

    tensors, _ = split(app_state(parts))
    estimate = space.needed_bytes(tmp_path, tensors)
    written = bytes_under(save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1)))
    assert written <= estimate < 2 * written  # errs towards caution, by headers only


def test_make_room_deletes_only_what_keep_last_would_and_only_when_allowed(tmp_path, monkeypatch):
    parts = toy.components()
    one = bytes_under(save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1)))
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2), SaveOptions(keep_last=2))
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 2.5))
    with pytest.raises(CheckpointSaveError, match="not enough free space"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3), SaveOptions(keep_last=2))  # not allowed: both verified ones stay
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1", "step_2"]
    save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3), SaveOptions(keep_last=2, make_room=True))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    with pytest.raises(CheckpointSaveError):  # keep_last 1 would leave no good checkpoint while saving
        save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4), SaveOptions(keep_last=1, make_room=True))
    assert find_latest(tmp_path).name == "step_3"


def test_a_failed_async_write_is_the_same_line_and_removes_its_partial(tmp_path, monkeypatch):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3))
    FullDisk(monkeypatch, tmp_path, "*.distcp")
    pending = save_async(SaveTarget(tmp_path, parts), TrainState(0, 6, 6))
    assert pending.wait(60)
    with pytest.raises(
        CheckpointSaveError, match=r"checkpoint step_6 not saved: ENOSPC No space left on device"
    ):
        pending.result()
    assert not step_dir(tmp_path, 6).exists() and find_latest(tmp_path).name == "step_3"


def test_a_failed_async_completion_is_a_failed_save(tmp_path, monkeypatch):
    parts = toy.components()
    FullDisk(monkeypatch, tmp_path, "*manifest.json*")
    pending = save_async(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    with pytest.raises(CheckpointSaveError, match="manifest.json"):
        pending.result(60)
    assert not step_dir(tmp_path, 2).exists() and not (tmp_path / LATEST).exists()


# ----------------------------------------------------------------------------- the hook


def make_recording_hook(tmp_path, **fields):
    hooks: list = []
    config = CheckpointConfig(**fields)
    target = SaveTarget(tmp_path, toy.components(), hooks=lambda: hooks, config={"k": 1},
                        data={"files": {}, "dataset": {"samples": 4}})  # fmt: skip
    hook = checkpoint_hook(config, target, Runtime(), restoring=config.restore_from != "none")
    hooks.append(hook)
    return hook


def advance_steps(hook, state: TrainState, count: int) -> TrainState:
    for _ in range(count):
        hook(Event.STEP_BEGIN, state, None)
        state = state.after_step()
        hook(Event.STEP_END, state, INFO)
    return state


def test_stop_is_the_default_and_raises_the_line_at_the_failed_save(tmp_path, monkeypatch):
    hook = make_recording_hook(tmp_path, save_every=3)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = advance_steps(hook, TrainState(), 3)
    FullDisk(monkeypatch, tmp_path, "*.distcp")
    with pytest.raises(CheckpointSaveError, match="checkpoint step_6 not saved.*step_3 is the newest good"):
        advance_steps(hook, state, 3)
    hook(Event.ABORT, state, RuntimeError("the loop passes it on"))
    assert saved_steps(tmp_path) == [3] and partial_step_dirs(tmp_path) == []


def test_continue_warns_on_each_failure_and_tries_again_at_the_next_cadence(tmp_path, monkeypatch, caplog):
    hook = make_recording_hook(tmp_path, save_every=2, on_save_failure="continue")
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = advance_steps(hook, TrainState(), 2)
    disk = FullDisk(monkeypatch, tmp_path, "*.distcp", times=2)  # saves at 4 and 6 fail, 8 works
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.checkpoint"):
        state = advance_steps(hook, state, 6)
    assert disk.times == 0 and saved_steps(tmp_path) == [2, 8]
    failures = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert len(failures) == 2 and "step_4 not saved" in failures[0] and "step_6 not saved" in failures[1]
    assert all("training goes on" in line and "step_2 is the newest good" in line for line in failures)
    meta = json.loads((step_dir(tmp_path, 8) / "meta.json").read_text())
    assert meta["data"] == {"files": {}, "dataset": {"samples": 4}}  # the data's fingerprint is recorded


def test_continue_retries_an_unsaved_last_step_at_the_end(tmp_path, monkeypatch):
    hook = make_recording_hook(tmp_path, save_every=2, on_save_failure="continue")
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    FullDisk(monkeypatch, tmp_path, "*.distcp", times=1)
    state = advance_steps(hook, TrainState(), 2)  # step 2's save fails
    hook(Event.TRAIN_END, state, None)  # the end tries step 2 again, and it works
    assert saved_steps(tmp_path) == [2]


def _recording_async(monkeypatch) -> list:
    started: list = []
    real = checkpoint_module.save_async

    def recording(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(checkpoint_module, "save_async", recording)
    return started


def test_a_failed_async_save_surfaces_at_the_next_step_boundary(tmp_path, monkeypatch):
    started = _recording_async(monkeypatch)
    hook = make_recording_hook(tmp_path, save_every=2, async_save=True)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    FullDisk(monkeypatch, tmp_path, "*.distcp")
    state = advance_steps(hook, TrainState(), 2)
    assert started and started[0].wait(60)  # the background write has failed by now
    with pytest.raises(CheckpointSaveError, match="checkpoint step_2 not saved"):
        hook(Event.STEP_BEGIN, state, None)  # the very next boundary, not the end of the run
    hook(Event.ABORT, state, RuntimeError("passed on"))
    assert saved_steps(tmp_path) == [] and partial_step_dirs(tmp_path) == [] and not step_dir(tmp_path, 2).exists()


def test_a_failed_async_save_under_continue_warns_at_the_next_boundary(tmp_path, monkeypatch, caplog):
    started = _recording_async(monkeypatch)
    hook = make_recording_hook(tmp_path, save_every=2, async_save=True, on_save_failure="continue")
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    FullDisk(monkeypatch, tmp_path, "*.distcp", times=1)
    state = advance_steps(hook, TrainState(), 2)
    assert started[0].wait(60)
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.checkpoint"):
        hook(Event.STEP_BEGIN, state, None)
    assert "checkpoint step_2 not saved" in caplog.text and "training goes on" in caplog.text
    state = state.after_step()
    hook(Event.STEP_END, state, INFO)
    state = advance_steps(hook, state, 1)  # step 4: saved in the background
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [4]


def test_on_save_failure_is_checked():
    with pytest.raises(ValueError, match="checkpoint.on_save_failure"):
        CheckpointConfig(on_save_failure="retry").validate()
    with pytest.raises(TypeError, match="checkpoint.make_room"):
        CheckpointConfig(make_room=1).validate()


# ----------------------------------------------------------------------------- the end of a run


def test_a_run_resumed_without_a_cadence_still_saves_its_new_end(tmp_path):
    hook = make_recording_hook(tmp_path, restore_from="latest")  # e.g. extended with allow_changes train.train_iters
    start = TrainState(0, 4, 4)
    hook(Event.TRAIN_BEGIN, start, None)
    state = advance_steps(hook, start, 2)
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [6]
    assert not saves_at_end(CheckpointConfig(), restoring=False) and saves_at_end(CheckpointConfig(), restoring=True)
    assert not saves_at_end(CheckpointConfig(save_at_end=False), restoring=True)


# ----------------------------------------------------------------------------- through a run


def tiny_save_config(tmp_path, **checkpoint):
    from fntrain.hooks.evaluate import EvaluateConfig
    from fntrain.hooks.progress import ProgressConfig
    from recipes import tiny_gpt

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(
        (Path(__file__).resolve().parents[2] / "fntrain/data/corpora/shakespeare.txt").read_bytes()[:3000]
    )
    base = tiny_gpt.Config()
    return tiny_gpt, dataclasses.replace(
        base, run_dir=str(tmp_path / "run"), log_every=0,
        model=dataclasses.replace(base.model, context=32, n_layer=1, n_head=2, d_model=32),
        data=dataclasses.replace(base.data, path=str(corpus)),
        train=dataclasses.replace(base.train, train_iters=8, global_batch_size=8, micro_batch_size=4),
        evaluate=EvaluateConfig(eval_every=0, at_end=False), progress=ProgressConfig(enabled=False),
        checkpoint=CheckpointConfig(**checkpoint),
    )  # fmt: skip


def test_a_run_stopped_by_a_full_disk_says_what_is_good_and_resumes(tmp_path, monkeypatch):
    from fntrain.run.job import RunAborted, run_job

    recipe, config = tiny_save_config(tmp_path, save_every=3)
    root = tmp_path / "run" / "checkpoints"
    real_save = checkpoint_module.save

    def full_from_step_6(root_, state, *args, **kwargs):
        if state.global_step == 6:
            FullDisk(monkeypatch, root, "*.distcp", times=1)
        return real_save(root_, state, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "save", full_from_step_6)
    with pytest.raises(RunAborted) as caught:
        run_job(config, recipe.spec)
    line = caught.value.line
    assert caught.value.exit_code == 1 and "\n" not in line
    # (a failed save names the step it was saving: step 6 finished, its save failed)
    assert re.match(r"run failed at step 6: CheckpointSaveError: checkpoint step_6 not saved: ENOSPC", line), line
    assert "step_3 is the newest good checkpoint" in line
    metadata = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert metadata["outcome"] == "failed" and "step_6 not saved" in metadata["error"]
    assert saved_steps(root) == [3] and partial_step_dirs(root) == []
    monkeypatch.setattr(checkpoint_module, "save", real_save)
    resumed = run_job(dataclasses.replace(config, checkpoint=CheckpointConfig(save_every=3, restore_from="latest")),
                      recipe.spec)  # fmt: skip
    assert resumed.state.global_step == 8 and saved_steps(root) == [3, 6, 8]


def test_extending_a_finished_run_saves_its_new_end(tmp_path):
    from fntrain.run.job import run_job

    recipe, config = tiny_save_config(tmp_path, save_every=4)
    run_job(config, recipe.spec)
    root = tmp_path / "run" / "checkpoints"
    assert saved_steps(root) == [4, 8]
    longer = dataclasses.replace(
        config, train=dataclasses.replace(config.train, train_iters=10),
        checkpoint=CheckpointConfig(restore_from="latest", allow_changes=("train.train_iters",)),
    )  # fmt: skip
    assert run_job(longer, recipe.spec).state.global_step == 10
    assert saved_steps(root) == [4, 8, 10]


def test_the_plan_lists_the_end_save_of_a_resumed_run():
    from fntrain.plan.report import _checkpoint_section
    from fntrain.state import make_run_plan

    plan = make_run_plan(global_batch_size=4, micro_batch_size=4, train_iters=10, dataset_len=100)
    resumed = _checkpoint_section(CheckpointConfig(restore_from="latest"), plan, restoring=True)
    assert resumed["enabled"] and resumed["steps"] == [10]
    assert _checkpoint_section(CheckpointConfig(), plan, restoring=False)["steps"] == []


# ----------------------------------------------------------------------------- slow: two ranks


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_fail_a_save_together_when_one_ranks_disk_is_full(tmp_path):
    """Rank 1's writes fail (its JSON part; its DCP data file, sync and async): both ranks raise the
    same line, none hangs, no partial stays, `latest` keeps step_1, and the next save works."""
    import sys

    from tests.helpers.ports import free_port
    from tests.helpers.workers import ROOT, run_ranks

    port = free_port()

    def env_of_rank(rank: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # fmt: skip
        return env

    def command_of_rank(rank: int) -> list[str]:
        return [sys.executable, "-m", "tests.checkpoint.save_fault_worker", str(tmp_path / "ckpt"),
                str(tmp_path / f"{rank}.json")]  # fmt: skip

    run_ranks(2, command_of_rank, env_of_rank, "the 2 save-fault workers", 200, tmp_path)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    seen, other = results[0]["seen"], results[1]["seen"]
    for case in seen:  # the same failure on both ranks (rank 0 alone removes the partial, says so)
        assert seen[case].split(" (needs")[0] == other[case].split(" (needs")[0], (seen[case], other[case])
        assert "was removed" in seen[case] and other[case].endswith(seen[case].split("; ")[-1])
    assert seen["json"].startswith("checkpoint step_2 not saved: rank 1: ENOSPC") and "rank_1.json" in seen["json"]
    for case, step in (("data", 3), ("async", 4)):
        assert seen[case].startswith(f"checkpoint step_{step} not saved: ENOSPC No space left on device"), seen
        assert "__1_0.distcp" in seen[case] and "step_1 is the newest good checkpoint" in seen[case]
    assert results[0]["complete"] == ["step_1", "step_5"]
    assert results[0]["entries"] == [LATEST, "step_1", "step_5"]  # no partial under any name
