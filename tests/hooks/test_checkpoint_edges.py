"""Checkpoint hook behaviours that nothing else pins (issue 30) [S36] [S19]: the `save_epochs` cadence
beyond every epoch, TRAIN_END and ABORT waiting for an async save in flight (a write held open by the
test, so the save is surely still running when the event arrives), and the preemption handlers removed
on ABORT."""

from __future__ import annotations

import signal
import threading

import pytest
import torch.distributed.checkpoint as dcp

from fntrain.checkpoint import SaveTarget, async_save, close_async_saves
from fntrain.checkpoint.layout import LATEST
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.checkpoint import toy
from tests.helpers.checkpoints import saved_steps
from tests.hooks.drive import drive

RELEASE_AFTER_S = 0.3  # a held write is released this long after the event that must wait for it


def make_hook(tmp_path, **fields):
    hooks: list = []
    hook = checkpoint_hook(CheckpointConfig(**fields), SaveTarget(tmp_path, toy.components(), hooks=lambda: hooks), Runtime())  # fmt: skip
    hooks.append(hook)
    return hook


@pytest.mark.parametrize(("save_epochs", "expected"), [(2, [6, 12]), (3, [9])])
def test_save_epochs_saves_at_the_end_of_every_kth_epoch(tmp_path, save_epochs, expected):
    """Epochs counted from 1: save_epochs=2 saves after the 2nd and 4th epochs (3 steps each), not after
    the 1st and 3rd."""
    hook = make_hook(tmp_path, save_epochs=save_epochs, save_at_end=False)
    state = TrainState()
    hook(Event.TRAIN_BEGIN, state, None)
    for _ in range(4):
        state = drive(hook, 3, start=state, begin=False, end=None, epoch_events=True).next_epoch()
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == expected


@pytest.fixture
def held_writes(monkeypatch):
    """DCP's writes wait until the returned event is set (in the writer's own thread); the joins of
    the stager's close() are cut to a moment, so only the hook's own waiting can see a save through."""
    gate = threading.Event()
    write_data = dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        assert gate.wait(60), "the test never released the write"
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held)
    close = async_save.close_async_saves
    monkeypatch.setattr(async_save, "close_async_saves", lambda timeout=5.0: close(timeout=0.05))
    yield gate
    gate.set()
    assert close_async_saves(timeout=30)


def release_soon(gate: threading.Event) -> threading.Timer:
    timer = threading.Timer(RELEASE_AFTER_S, gate.set)
    timer.start()
    return timer


def test_train_end_waits_for_the_async_save_in_flight(tmp_path, held_writes):
    hook = make_hook(tmp_path, save_every=4, async_save=True)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 4, begin=False, end=None)  # step 4's save is in flight, its write held
    assert saved_steps(tmp_path) == [] and not held_writes.is_set()
    release_soon(held_writes)
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [4]
    assert (tmp_path / LATEST).read_text().strip() == "step_4"


def test_train_end_raises_when_the_async_save_in_flight_failed(tmp_path, monkeypatch):
    """The last checkpoint's background write fails after the last step: TRAIN_END, which drains it,
    is where the run learns it (a run must not report success without its final checkpoint)."""
    write_data = dcp.FileSystemWriter.write_data

    def fails_at_step_4(self, plan, planner):
        if str(self.path).endswith("step_4"):
            raise OSError("disk full")
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fails_at_step_4)
    hook = make_hook(tmp_path, save_every=2, async_save=True)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 4, begin=False, end=None)
    with pytest.raises(RuntimeError, match="checkpoint step_4 not saved: disk full"):
        hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [2]
    assert close_async_saves(timeout=30)


def test_abort_waits_for_the_async_save_in_flight(tmp_path, held_writes):
    """A crash while a save is being written: ABORT waits (up to abort_wait_s) and completes it, so the
    step just saved is not lost."""
    hook = make_hook(tmp_path, save_every=2, async_save=True, abort_wait_s=60.0)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 2, begin=False, end=None)
    assert saved_steps(tmp_path) == []
    release_soon(held_writes)
    hook(Event.ABORT, state, RuntimeError("crash"))
    assert saved_steps(tmp_path) == [2]
    assert (tmp_path / LATEST).read_text().strip() == "step_2"


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.mark.parametrize("in_flight", [False, True], ids=["idle", "async_save_in_flight"])
def test_abort_removes_the_preemption_handlers(tmp_path, in_flight):
    before = {number: signal.getsignal(number) for number in PREEMPTION_SIGNALS}
    hook = make_hook(tmp_path, save_every=2, async_save=in_flight, save_on_interrupt=True)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert all(signal.getsignal(number) is not before[number] for number in PREEMPTION_SIGNALS)
    state = drive(hook, 2, begin=False, end=None)
    hook(Event.ABORT, state, RuntimeError("crash"))
    assert {number: signal.getsignal(number) for number in PREEMPTION_SIGNALS} == before
    assert close_async_saves(timeout=30)
