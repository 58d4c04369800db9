"""Behaviours of the watchdog hook that mutation testing found unpinned (mutation/RESULTS.md): the
watchdog it starts gets the run's clock, abort, rank, world size and stacks folder; every event gives it
the heartbeat a hang report names (what, and at which step); TRAIN_END and ABORT stop it, and a thread
that does not stop is one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fntrain.hooks import watchdog as hook_module
from fntrain.hooks.watchdog import watchdog_hook
from fntrain.loop import Event
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.watchdog import WatchdogConfig
from fntrain.state import TrainState


class RecordingWatchdog:
    """Stands in for the rank's `Watchdog`: records how it was made and what the hook told it."""

    made: list[RecordingWatchdog] = []

    def __init__(self, config, **kwargs):
        self.config, self.kwargs, self.calls, self.stops = config, kwargs, [], True
        RecordingWatchdog.made.append(self)

    def beat(self, what, step):
        self.calls.append(("beat", what, step))

    def step_done(self, step):
        self.calls.append(("step_done", step))

    def start(self):
        self.calls.append(("start",))

    def stop(self):
        self.calls.append(("stop",))
        return self.stops


@pytest.fixture
def recording(monkeypatch):
    RecordingWatchdog.made = []
    monkeypatch.setattr(hook_module, "Watchdog", RecordingWatchdog)
    return RecordingWatchdog.made


def clock() -> float:
    return 0.0


def aborted(code: int) -> None:
    pass


def hook_for(tmp_path: Path):
    runtime = Runtime(rank=2, world_size=4)
    return watchdog_hook(WatchdogConfig(), runtime, tmp_path / "run", clock=clock, abort=aborted)


def test_the_watchdog_gets_the_runs_clock_abort_rank_world_and_stacks_folder(tmp_path, recording):
    hook_for(tmp_path)(Event.TRAIN_BEGIN, TrainState(0, 5, 0), None)
    (dog,) = recording
    assert dog.kwargs == {"rank": 2, "stacks_dir": tmp_path / "run" / "stacks", "clock": clock, "abort": aborted,
                          "world_size": 4}  # fmt: skip
    assert dog.calls == [("beat", "train begin", 5), ("start",)]


@pytest.mark.parametrize("end", [Event.TRAIN_END, Event.ABORT])
def test_each_event_is_a_heartbeat_naming_itself_and_its_step_until_the_end_stops_it(tmp_path, recording, end):
    hook = hook_for(tmp_path)
    for event in (Event.EPOCH_BEGIN, Event.STEP_BEGIN, Event.STEP_END, Event.EPOCH_END, end):
        hook(event, TrainState(0, 3, 0), None)  # before TRAIN_BEGIN: nothing is running, nothing happens
    assert recording == []
    hook(Event.TRAIN_BEGIN, TrainState(1, 7, 2), None)
    hook(Event.EPOCH_BEGIN, TrainState(1, 7, 2), None)
    hook(Event.STEP_BEGIN, TrainState(1, 7, 2), None)
    hook(Event.STEP_END, TrainState(1, 8, 3), None)
    hook(Event.EPOCH_END, TrainState(1, 8, 3), None)
    hook(end, TrainState(1, 8, 3), None)
    (dog,) = recording
    assert dog.calls == [
        ("beat", "train begin", 7), ("start",), ("beat", "epoch begin", 7), ("beat", "step", 8),
        ("step_done", 8), ("beat", "epoch end", 8), ("stop",),
    ]  # fmt: skip
    hook(Event.STEP_BEGIN, TrainState(1, 8, 3), None)  # stopped and forgotten
    assert dog.calls[-1] == ("stop",)


def test_a_watchdog_thread_that_does_not_stop_is_one_warning(tmp_path, recording, caplog):
    hook = hook_for(tmp_path)
    for stops, said in ((True, []), (False, ["the watchdog thread did not stop within 5 s"])):
        hook(Event.TRAIN_BEGIN, TrainState(), None)
        recording[-1].stops = stops
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fntrain.watchdog"):
            hook(Event.TRAIN_END, TrainState(), None)
        assert [r.getMessage() for r in caplog.records] == said
