"""The memory recording hook [S35], driven with a stand-in allocator that records every call."""

from __future__ import annotations

import logging
import os
import pickle
import re
import sys
import types

import pytest
import torch

from fntrain.hooks import memory as memory_mod
from fntrain.hooks.memory import MemoryConfig, memory_hook
from fntrain.loop import Event, train
from fntrain.runtime.allocator import is_out_of_memory
from fntrain.runtime.runtime import Runtime
from fntrain.state import RunPlan, TrainState
from tests.hooks.drive import drive

CUDA = torch.device("cuda", 0)  # constructing a device touches nothing
SNAPSHOT_NAME = re.compile(r"^snapshot_\d{4}-\d{2}-\d{2}-\d{2}-\d{2}_(\d+)\.pickle$")


class FakeAllocator:
    """torch.cuda.memory's private API, recording calls; `fail` names calls that raise."""

    def __init__(self, *, fail: tuple[str, ...] = ()) -> None:
        self.calls: list[tuple] = []
        self.fail = set(fail)
        self.stop_failures = 0  # the next this-many stops fail (besides "stop" in fail)
        self.recording = False
        self.history: list[str] = []
        self.allocated = 1 << 30  # memory in use now, and the peaks since the last reset
        self.reserved = 2 << 30
        self.peak_allocated = 2 << 20

    def _record_memory_history(self, enabled="all", **kwargs):
        self.calls.append(("record", enabled, kwargs))
        if enabled is not None and "start" in self.fail:
            raise RuntimeError(f"record({enabled!r}) failed")
        if enabled is None and ("stop" in self.fail or self.stop_failures):
            self.stop_failures = max(0, self.stop_failures - 1)
            raise RuntimeError("stop failed")
        self.recording = enabled is not None
        if enabled is None:
            self.history.clear()

    def _snapshot(self):
        self.calls.append(("snapshot",))
        if "snapshot" in self.fail:
            raise RuntimeError("snapshot failed")
        return {"segments": [{"total_size": 1}], "device_traces": [list(self.history)]}

    def max_memory_reserved(self, device):
        self.calls.append(("max_reserved", device))
        return 3 << 20

    def max_memory_allocated(self, device):
        self.calls.append(("max_allocated", device))
        return self.peak_allocated

    def reset_peak_memory_stats(self, device):
        self.calls.append(("reset_peaks", device))

    def memory_allocated(self, device):
        self.calls.append(("allocated", device))
        return self.allocated

    def memory_reserved(self, device):
        self.calls.append(("reserved", device))
        return self.reserved

    def names(self) -> list[str]:
        """The calls as short names: start, stop, snapshot, ..."""
        out = []
        for call in self.calls:
            if call[0] == "record":
                out.append("stop" if call[1] is None else "start")
            else:
                out.append(call[0])
        return out


class ObservedAllocator(FakeAllocator):
    """A backend with an OOM observer API (like torch._C._cuda_attach_out_of_memory_observer)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.observers: list = []

    def attach_out_of_memory_observer(self, observer) -> None:
        self.observers.append(observer)

    def out_of_memory(self) -> None:
        """What the allocator does when an allocation fails: call every observer."""
        self.history.append("oom")
        for observer in self.observers:
            observer(0, 1 << 40, 1 << 30, 0)


def snapshots(path) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def memory_config(tmp_path, **kw) -> MemoryConfig:
    kw.setdefault("enable", True)
    return MemoryConfig(save_path=str(tmp_path / "snap"), **kw)


# --- config and validation -----------------------------------------------------------------------------


def test_defaults_match_the_spec():
    c = MemoryConfig()
    assert (c.enable, c.start_step, c.end_step, c.save_path) == (False, 1, 2, "./memory_snapshot")
    assert (c.dump_ranks, c.stacks, c.max_entries, c.mem_info) == ([0], "all", None, False)
    with pytest.raises(AttributeError):
        c.enable = True  # frozen


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"enable": 1}, TypeError, "memory.enable"),
        ({"mem_info": "yes"}, TypeError, "memory.mem_info"),
        ({"start_step": True}, TypeError, "memory.start_step"),
        ({"end_step": 2.0}, TypeError, "memory.end_step"),
        ({"start_step": -1}, ValueError, "memory.start_step"),
        ({"start_step": 3, "end_step": 2}, ValueError, "memory.end_step"),
        ({"save_path": ""}, ValueError, "memory.save_path"),
        ({"save_path": "  "}, ValueError, "memory.save_path"),
        ({"save_path": None}, TypeError, "memory.save_path"),
        ({"dump_ranks": 0}, TypeError, "memory.dump_ranks"),
        ({"dump_ranks": [0, True]}, TypeError, "memory.dump_ranks"),
        ({"dump_ranks": [-1]}, ValueError, "memory.dump_ranks"),
        ({"stacks": "cpp"}, ValueError, "memory.stacks"),
        ({"max_entries": 0}, ValueError, "memory.max_entries"),
        ({"max_entries": True}, TypeError, "memory.max_entries"),
        ({"max_entries": 1.5}, TypeError, "memory.max_entries"),
    ],
)
def test_invalid_configs_fail_before_device_resolution(monkeypatch, kwargs, error, message):
    def no_device(*args, **kw):
        raise AssertionError("the device was resolved before validation")

    monkeypatch.setattr(memory_mod, "default_allocator", no_device)
    with pytest.raises(error, match=re.escape(message)):
        memory_hook(MemoryConfig(**{"enable": True, **kwargs}), Runtime(device=CUDA))


def test_valid_edge_values_pass(tmp_path):
    """The edge values are accepted and mean what they say: a window at control point 0 only, recorded
    with those stacks and that entry limit, and written by no rank (dump_ranks=[])."""
    edge = memory_config(tmp_path, start_step=0, end_step=0, dump_ranks=[], max_entries=1, stacks="python")
    assert edge.validate() is None
    fake = FakeAllocator()
    drive(memory_hook(edge, Runtime(device=CUDA), allocator=fake), 2)
    starts = [call for call in fake.calls if call[0] == "record" and call[1] is not None]
    assert [(call[1], call[2]["max_entries"], call[2]["stacks"]) for call in starts] == [("all", 1, "python")]
    assert "snapshot" not in fake.names() and snapshots(tmp_path / "snap") == []


def test_enable_on_cpu_names_the_device(tmp_path):
    with pytest.raises(RuntimeError, match="cpu"):
        memory_hook(memory_config(tmp_path), Runtime())
    assert not (tmp_path / "snap").exists()


@pytest.mark.parametrize(
    "missing, named",
    [
        (("_record_memory_history",), "_record_memory_history"),
        (("_snapshot", "_dump_snapshot"), "_snapshot or _dump_snapshot"),
    ],
)
def test_missing_history_api_is_named(tmp_path, missing, named):
    module = types.ModuleType("torch.cuda.memory_stub")
    fake = FakeAllocator()
    for name in ("_record_memory_history", "_snapshot", "_dump_snapshot"):
        if name not in missing:
            setattr(module, name, getattr(fake, name, lambda *a, **k: None))
    with pytest.raises(RuntimeError, match=re.escape(named)):
        memory_hook(memory_config(tmp_path), Runtime(device=CUDA), allocator=module)


def test_missing_stats_api_is_named_for_mem_info():
    module = types.SimpleNamespace(max_memory_allocated=lambda d: 0, reset_peak_memory_stats=lambda d: None)
    with pytest.raises(RuntimeError, match="max_memory_reserved"):
        memory_hook(MemoryConfig(mem_info=True), Runtime(device=CUDA), allocator=module)


def test_cuda_backend_resolves_without_touching_the_device(tmp_path):
    # torch.cuda.memory exists even in a CPU build; building the hook must not initialise CUDA.
    hook = memory_hook(memory_config(tmp_path), Runtime(device=CUDA))
    assert callable(hook)
    assert not torch.cuda.is_initialized()
    hook(Event.ABORT, TrainState(), RuntimeError("before TRAIN_BEGIN"))  # a no-op, never raises
    assert not torch.cuda.is_initialized()


# --- disabled -------------------------------------------------------------------------------------------


def test_disabled_session_never_touches_the_device(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_mod, "default_allocator", lambda *a: pytest.fail("device resolved"))
    fake = FakeAllocator()
    for hook in (
        memory_hook(MemoryConfig(save_path=str(tmp_path / "snap")), Runtime(device=CUDA)),
        memory_hook(MemoryConfig(save_path=str(tmp_path / "snap")), Runtime(device=CUDA), allocator=fake),
    ):
        drive(hook, 4)
        hook(Event.ABORT, TrainState(), RuntimeError("x"))
    assert fake.calls == []
    assert not (tmp_path / "snap").exists()


# --- the window -----------------------------------------------------------------------------------------


def test_window_1_to_3_records_once_then_writes_and_stops(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(
        memory_config(tmp_path, start_step=1, end_step=3, max_entries=500), Runtime(device=CUDA), allocator=fake
    )
    state = TrainState()
    hook(Event.TRAIN_BEGIN, state, None)  # control point 0: stale history discarded, nothing recorded
    assert fake.names() == ["stop"] and not fake.recording
    seen = []
    for _ in range(5):
        hook(Event.STEP_BEGIN, state, None)
        seen.append(fake.names()[1:])
        state = state.after_step()
        hook(Event.STEP_END, state, None)
    hook(Event.TRAIN_END, state, None)
    # control point 1 starts, 2 does nothing, 3 writes and stops, 4 and 5 and TRAIN_END do nothing
    assert seen == [["start"], ["start"], ["start", "snapshot", "stop"]] + [["start", "snapshot", "stop"]] * 2
    assert fake.names() == ["stop", "start", "snapshot", "stop"]
    start = fake.calls[1]
    assert start[1] == "all" and start[2]["stacks"] == "all" and start[2]["max_entries"] == 500
    [name] = snapshots(tmp_path / "snap")
    assert SNAPSHOT_NAME.match(name).group(1) == "0"
    with open(tmp_path / "snap" / name, "rb") as f:
        snapshot = pickle.load(f)
    assert set(snapshot) >= {"segments", "device_traces"}


def test_unbounded_max_entries_is_passed_as_sys_maxsize(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, stacks="python"), Runtime(device=CUDA), allocator=fake)
    drive(hook, 1)
    start = [c for c in fake.calls if c[0] == "record" and c[1] == "all"][0]
    assert start[2]["max_entries"] == sys.maxsize and start[2]["stacks"] == "python"


def test_equal_bounds_at_zero_record_write_and_stop_at_train_begin(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=0, end_step=0), Runtime(device=CUDA), allocator=fake)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert fake.names() == ["stop", "start", "snapshot", "stop"]
    assert len(snapshots(tmp_path / "snap")) == 1
    drive(hook, 0)  # a second session is a fresh start and records again
    assert fake.names()[4:] == ["stop", "start", "snapshot", "stop"]


def test_equal_bounds_mid_run(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=2, end_step=2), Runtime(device=CUDA), allocator=fake)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.STEP_BEGIN, TrainState(), None)
    assert fake.names() == ["stop"]
    hook(Event.STEP_BEGIN, TrainState(), None)
    assert fake.names() == ["stop", "start", "snapshot", "stop"]


def test_window_past_the_run_records_nothing(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=5, end_step=9), Runtime(device=CUDA), allocator=fake)
    drive(hook, 3)
    assert fake.names() == ["stop"]
    assert not (tmp_path / "snap").exists()


def test_unselected_rank_records_but_never_writes_or_makes_directories(tmp_path):
    fake = FakeAllocator()
    runtime = Runtime(rank=1, world_size=2, device=CUDA)
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=2, dump_ranks=[0]), runtime, allocator=fake)
    drive(hook, 3)
    assert fake.names() == ["stop", "start", "stop"]
    assert not (tmp_path / "snap").exists()


def test_selected_nonzero_rank_writes_its_own_file(tmp_path):
    fake = FakeAllocator()
    runtime = Runtime(rank=3, world_size=4, device=CUDA)
    hook = memory_hook(memory_config(tmp_path, dump_ranks=[1, 3]), runtime, allocator=fake)
    drive(hook, 3)
    [name] = snapshots(tmp_path / "snap")
    assert SNAPSHOT_NAME.match(name).group(1) == "3"


def test_dump_ranks_outside_the_world_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.memory"):
        memory_hook(
            memory_config(tmp_path, dump_ranks=[4]), Runtime(world_size=2, device=CUDA), allocator=FakeAllocator()
        )
    assert "no snapshot will be written" in caplog.text


def test_save_path_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    fake = FakeAllocator()
    hook = memory_hook(MemoryConfig(enable=True, save_path="~/snaps"), Runtime(device=CUDA), allocator=fake)
    drive(hook, 2)
    assert len(snapshots(tmp_path / "snaps")) == 1


def test_a_backend_with_only_dump_snapshot_writes_through_it(tmp_path):
    fake = FakeAllocator()
    dumped = []
    module = types.SimpleNamespace(
        _record_memory_history=fake._record_memory_history,
        _dump_snapshot=lambda path: (dumped.append(path), open(path, "wb").close()),
    )
    hook = memory_hook(memory_config(tmp_path), Runtime(device=CUDA), allocator=module)
    drive(hook, 2)
    [name] = snapshots(tmp_path / "snap")
    assert SNAPSHOT_NAME.match(name) and dumped == [str(tmp_path / "snap" / name)]


# --- stop, abort and failures ---------------------------------------------------------------------------


def test_stop_writes_a_partial_window_once_even_when_called_twice(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 3, end=None)
    assert fake.names() == ["stop", "start"] and fake.recording
    hook(Event.TRAIN_END, TrainState(0, 3, 3), None)
    hook(Event.TRAIN_END, TrainState(0, 3, 3), None)
    assert fake.names() == ["stop", "start", "snapshot", "stop"]
    assert len(snapshots(tmp_path / "snap")) == 1
    hook(Event.ABORT, TrainState(0, 3, 3), RuntimeError("late"))  # after the end: nothing more
    assert fake.names() == ["stop", "start", "snapshot", "stop"]


def test_abort_never_writes_nor_creates_directories(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 2, end=None)
    hook(Event.ABORT, TrainState(0, 2, 2), ValueError("step failed"))
    assert fake.names() == ["stop", "start", "stop"] and not fake.recording
    assert not (tmp_path / "snap").exists()
    hook(Event.ABORT, TrainState(0, 2, 2), ValueError("again"))  # a second ABORT is a no-op
    hook(Event.TRAIN_END, TrainState(0, 2, 2), None)
    assert fake.names() == ["stop", "start", "stop"]


def test_abort_never_raises_even_when_stopping_fails(tmp_path, caplog):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 1, end=None)
    fake.fail.add("stop")
    with caplog.at_level(logging.ERROR, logger="fntrain.hooks.memory"):
        hook(Event.ABORT, TrainState(0, 1, 1), ValueError("boom"))
    assert "stop failed" in caplog.text
    assert not (tmp_path / "snap").exists()


def test_a_failed_stop_at_train_end_is_retried_at_abort(tmp_path, caplog):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 2, end=None)
    fake.stop_failures = 1
    with pytest.raises(RuntimeError, match="stop failed") as caught:
        hook(Event.TRAIN_END, TrainState(0, 2, 2), None)  # writes the partial window, then the stop fails
    assert fake.names() == ["stop", "start", "snapshot", "stop"] and fake.recording  # history stays on
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.memory"):
        hook(Event.ABORT, TrainState(0, 2, 2), caught.value)  # what the loop does next: retry the stop
    assert fake.names() == ["stop", "start", "snapshot", "stop", "stop"] and not fake.recording
    assert "retrying the stop" in caplog.text
    assert len(snapshots(tmp_path / "snap")) == 1  # ABORT wrote nothing more
    hook(Event.ABORT, TrainState(0, 2, 2), caught.value)  # stopped now: a further ABORT is a no-op
    assert fake.names().count("stop") == 3


def test_a_stop_failing_again_at_abort_is_logged_not_raised(tmp_path, caplog):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 1, end=None)
    fake.fail.add("stop")
    with pytest.raises(RuntimeError, match="stop failed") as caught:
        hook(Event.TRAIN_END, TrainState(0, 1, 1), None)
    with caplog.at_level(logging.ERROR, logger="fntrain.hooks.memory"):
        hook(Event.ABORT, TrainState(0, 1, 1), caught.value)  # never raises
    assert fake.names()[-2:] == ["stop", "stop"] and fake.recording
    assert any("stopping the memory history raised" in r.getMessage() for r in caplog.records)
    fake.fail.discard("stop")
    hook(Event.TRAIN_BEGIN, TrainState(), None)  # a new session discards the stale history first
    assert not fake.recording


def test_in_the_loop_a_failed_stop_at_train_end_is_retried_by_the_abort(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)

    def step_fn(state, batch):
        if state.global_step == 1:
            fake.stop_failures = 1  # the stop at TRAIN_END fails once
        return {}

    with pytest.raises(RuntimeError, match="stop failed"):
        train(TrainState(), step_fn, [hook], data=lambda e, c: iter(range(c, 2)), plan=RunPlan(2, 2, 1))
    assert fake.names() == ["stop", "start", "snapshot", "stop", "stop"] and not fake.recording


def test_abort_before_train_begin_is_a_no_op(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=0), Runtime(device=CUDA), allocator=fake)
    hook(Event.ABORT, TrainState(), RuntimeError("setup failed"))
    assert fake.calls == []


@pytest.mark.parametrize("failure", ["snapshot", "directory"])
def test_failed_write_still_stops_history_and_reraises(tmp_path, failure):
    fake = FakeAllocator(fail=("snapshot",) if failure == "snapshot" else ())
    save_path = tmp_path / "snap"
    if failure == "directory":
        save_path.write_text("a file where the folder should be")
    hook = memory_hook(
        MemoryConfig(enable=True, start_step=1, end_step=2, save_path=str(save_path)),
        Runtime(device=CUDA),
        allocator=fake,
    )
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.STEP_BEGIN, TrainState(), None)
    with pytest.raises((RuntimeError, OSError)) as caught:
        hook(Event.STEP_BEGIN, TrainState(0, 1, 1), None)
    if failure == "snapshot":
        assert "snapshot failed" in str(caught.value)
    assert fake.names() == ["stop", "start", "snapshot", "stop"] and not fake.recording
    hook(Event.ABORT, TrainState(0, 1, 1), caught.value)  # what the loop does next: nothing more
    assert fake.names() == ["stop", "start", "snapshot", "stop"]
    if failure == "snapshot":
        assert not save_path.exists()


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path), Runtime(device=CUDA), allocator=fake)

    def broken_dump(obj, f):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(pickle, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        drive(hook, 2)
    assert snapshots(tmp_path / "snap") == []
    assert not fake.recording


def test_failed_record_cleans_up_and_deactivates(tmp_path):
    fake = FakeAllocator(fail=("start",))
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=3), Runtime(device=CUDA), allocator=fake)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    with pytest.raises(RuntimeError, match="record"):
        hook(Event.STEP_BEGIN, TrainState(), None)
    assert fake.names() == ["stop", "start", "stop"]
    for _ in range(3):
        hook(Event.STEP_BEGIN, TrainState(), None)
    hook(Event.ABORT, TrainState(), RuntimeError("record failed"))
    hook(Event.TRAIN_END, TrainState(), None)
    assert fake.names() == ["stop", "start", "stop"]
    assert not (tmp_path / "snap").exists()


def test_a_new_session_discards_stale_history_without_writing(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=5), Runtime(device=CUDA), allocator=fake)
    drive(hook, 2, end=None)  # a session left recording (its TRAIN_END never came)
    fake.history.append("stale alloc")
    assert fake.recording
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert fake.names() == ["stop", "start", "stop"]
    assert fake.history == [] and not fake.recording
    assert not (tmp_path / "snap").exists()
    # ... and the new session's window counts from its own TRAIN_BEGIN
    for _ in range(5):
        hook(Event.STEP_BEGIN, TrainState(), None)
    assert fake.names()[3:] == ["start", "snapshot", "stop"]


def test_history_left_by_someone_else_is_discarded_at_train_begin(tmp_path):
    fake = FakeAllocator()
    fake._record_memory_history("all")
    fake.history.append("another recorder's event")
    fake.calls.clear()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=2), Runtime(device=CUDA), allocator=fake)
    drive(hook, 2)
    with open(tmp_path / "snap" / snapshots(tmp_path / "snap")[0], "rb") as f:
        assert pickle.load(f)["device_traces"] == [[]]


# --- out-of-memory snapshots ----------------------------------------------------------------------------


def test_oom_observer_writes_a_snapshot_at_the_failure(tmp_path):
    fake = ObservedAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    fake.out_of_memory()  # before the window: no snapshot
    assert snapshots(tmp_path / "snap") == []
    hook(Event.STEP_BEGIN, TrainState(), None)
    assert len(fake.observers) == 1
    fake.out_of_memory()  # inside the step, before the stack unwinds
    assert snapshots(tmp_path / "snap") == ["snapshot_oom_0.pickle"]
    with open(tmp_path / "snap" / "snapshot_oom_0.pickle", "rb") as f:
        assert "oom" in pickle.load(f)["device_traces"][0]
    hook(Event.ABORT, TrainState(), torch.OutOfMemoryError("CUDA out of memory"))
    assert fake.names() == ["stop", "start", "snapshot", "stop"]  # ABORT did not write it again
    assert snapshots(tmp_path / "snap") == ["snapshot_oom_0.pickle"]
    fake.out_of_memory()  # after the session: the observer forwards nowhere
    assert fake.names().count("snapshot") == 1


def test_oom_observer_is_attached_once_per_backend(tmp_path):
    fake = ObservedAllocator()
    for _ in range(3):
        hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=2), Runtime(device=CUDA), allocator=fake)
        drive(hook, 2)
    assert len(fake.observers) == 1


def test_oom_observer_never_raises_into_the_allocator(tmp_path, caplog):
    fake = ObservedAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 1, end=None)
    fake.fail.add("snapshot")
    with caplog.at_level(logging.ERROR, logger="fntrain.hooks.memory"):
        fake.out_of_memory()
    assert "could not write the out-of-memory snapshot" in caplog.text


def test_oom_observer_on_an_unselected_rank_writes_nothing(tmp_path):
    fake = ObservedAllocator()
    runtime = Runtime(rank=1, world_size=2, device=CUDA)
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), runtime, allocator=fake)
    drive(hook, 1, end=None)
    fake.out_of_memory()
    hook(Event.ABORT, TrainState(), torch.OutOfMemoryError("oom"))
    assert not (tmp_path / "snap").exists()


def test_without_an_observer_abort_writes_the_oom_snapshot(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 2, end=None)
    hook(Event.ABORT, TrainState(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert snapshots(tmp_path / "snap") == ["snapshot_oom_0.pickle"]
    assert fake.names() == ["stop", "start", "snapshot", "stop"]


def test_abort_oom_outside_the_window_writes_nothing(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=3, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 1, end=None)
    hook(Event.ABORT, TrainState(), torch.OutOfMemoryError("oom"))
    assert not (tmp_path / "snap").exists()


def test_abort_oom_snapshot_failure_is_logged_not_raised(tmp_path, caplog):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=10), Runtime(device=CUDA), allocator=fake)
    drive(hook, 1, end=None)
    fake.fail.add("snapshot")
    with caplog.at_level(logging.ERROR, logger="fntrain.hooks.memory"):
        hook(Event.ABORT, TrainState(), torch.OutOfMemoryError("oom"))
    assert "could not write the out-of-memory snapshot" in caplog.text
    assert not fake.recording


def test_is_out_of_memory():
    class NPUOutOfMemoryError(RuntimeError):
        pass

    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert is_out_of_memory(NPUOutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("NPU out of memory. Tried to allocate 1.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))
    assert not is_out_of_memory(None)


# --- mem_info -------------------------------------------------------------------------------------------


def test_mem_info_without_history_logs_and_resets_peaks(caplog):
    fake = FakeAllocator()
    runtime = Runtime(rank=2, local_rank=0, world_size=4, dp_rank=2, device=CUDA)
    hook = memory_hook(MemoryConfig(mem_info=True), runtime, allocator=fake)
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.memory"):
        drive(hook, 2)
    assert "record" not in [c[0] for c in fake.calls]  # no history
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory step=")]
    assert [line.split()[1] for line in lines] == ["step=0", "step=1", "step=2", "step=end"]
    assert all("rank=2 local_rank=0 dp_rank=2" in line for line in lines)
    assert "peak_reserved_mib=3.0 peak_allocated_mib=2.0" in lines[0]
    assert [c[0] for c in fake.calls].count("reset_peaks") == 4
    assert fake.calls[:3] == [("max_reserved", CUDA), ("max_allocated", CUDA), ("reset_peaks", CUDA)]


def test_mem_info_names_the_tensor_parallel_rank_and_pipeline_stage(caplog):
    runtime = Runtime(rank=5, world_size=8, dp_rank=0, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1)
    hook = memory_hook(MemoryConfig(mem_info=True), runtime)
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.memory"):
        drive(hook, 1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory step=")]
    assert lines and all("rank=5 local_rank=0 dp_rank=0 tp_rank=1 pp_stage=1" in line for line in lines)


def test_mem_info_on_cpu_reports_peak_rss(caplog):
    hook = memory_hook(MemoryConfig(mem_info=True), Runtime())
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.memory"):
        drive(hook, 1)
    assert "cannot be reset" in caplog.text
    rss = [r.getMessage() for r in caplog.records if "peak_rss_mib=" in r.getMessage()]
    assert len(rss) == 3
    assert float(rss[0].split("peak_rss_mib=")[1]) > 1.0


def test_mem_info_logs_device_memory_after_each_epoch(caplog):
    fake = FakeAllocator()
    hook = memory_hook(MemoryConfig(mem_info=True), Runtime(device=CUDA), allocator=fake)
    peaks = {1: 5 << 30, 2: 3 << 29, 3: 1 << 30, 4: 3 << 30}  # peak allocated during each step

    def step_fn(state, batch):
        fake.peak_allocated = peaks[state.global_step + 1]
        return {}

    with caplog.at_level(logging.INFO, logger="fntrain.hooks.memory"):
        train(TrainState(), step_fn, [hook], data=lambda e, c: iter(range(c, 2)), plan=RunPlan(4, 2, 2))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("VRAM usage")]
    # the peak of the epoch, though the per-step peaks are reset at every control point
    assert [line.split(" (")[0] for line in lines] == [
        "VRAM usage after epoch 0: allocated 1.00 GiB, reserved 2.00 GiB, peak 5.00 GiB",
        "VRAM usage after epoch 1: allocated 1.00 GiB, reserved 2.00 GiB, peak 3.00 GiB",
    ]
    assert "rank=0" in lines[0]


def test_mem_info_epoch_line_not_repeated_for_a_restored_finished_epoch(caplog):
    hook = memory_hook(MemoryConfig(mem_info=True), Runtime(device=CUDA), allocator=FakeAllocator())
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.memory"):
        hook(Event.TRAIN_BEGIN, TrainState(0, 2, 2), None)
        hook(Event.EPOCH_END, TrainState(0, 2, 2), None)  # replayed: the checkpoint ended the epoch
    assert "VRAM usage" not in caplog.text


def test_mem_info_on_cpu_logs_peak_rss_after_each_epoch(caplog):
    hook = memory_hook(MemoryConfig(mem_info=True), Runtime())
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.memory"):
        train(
            TrainState(), lambda s, b: {}, [hook], data=lambda e, c: iter(range(c, 1)), plan=RunPlan(2, 1, 2)
        )
    lines = [r.getMessage() for r in caplog.records if "after epoch" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["memory after epoch 0", "memory after epoch 1"]
    assert all(float(line.split("peak_rss_mib=")[1].split()[0]) > 1.0 for line in lines)


def test_mem_info_and_history_together(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(
        memory_config(tmp_path, start_step=1, end_step=2, mem_info=True), Runtime(device=CUDA), allocator=fake
    )
    drive(hook, 2)
    names = fake.names()
    assert names.count("start") == 1 and names.count("snapshot") == 1 and names.count("reset_peaks") == 4


# --- backends and the loop ------------------------------------------------------------------------------


def test_npu_backend_through_torch_npu(monkeypatch, tmp_path):
    fake = ObservedAllocator()
    memory_module = types.ModuleType("torch_npu.npu.memory")
    for name in ("_record_memory_history", "_snapshot", "max_memory_reserved", "max_memory_allocated",
                 "reset_peak_memory_stats"):  # fmt: skip
        setattr(memory_module, name, getattr(fake, name))
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.npu = types.SimpleNamespace(memory=memory_module)
    torch_npu._C = types.SimpleNamespace(
        _npu_attach_out_of_memory_observer=fake.attach_out_of_memory_observer
    )
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    runtime = Runtime(device=types.SimpleNamespace(type="npu", index=0))
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=3), runtime)
    drive(hook, 1, end=None)
    assert fake.observers, "the NPU OOM observer was not attached"
    fake.out_of_memory()
    hook(Event.TRAIN_END, TrainState(), None)
    files = snapshots(tmp_path / "snap")
    assert "snapshot_oom_0.pickle" in files and any(SNAPSHOT_NAME.match(f) for f in files)


def test_npu_without_torch_npu_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(RuntimeError, match="torch_npu"):
        memory_hook(memory_config(tmp_path), Runtime(device=types.SimpleNamespace(type="npu", index=0)))


def test_in_the_loop_control_points_precede_the_steps_work(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=2, end_step=3), Runtime(device=CUDA), allocator=fake)

    def step(state, batch):
        fake.calls.append(("step", state.global_step + 1))
        return {}

    plan = RunPlan(train_iters=4, steps_per_epoch=4, epochs=1)
    final = train(TrainState(), step, [hook], data=lambda epoch, cursor: iter(range(cursor, 4)), plan=plan).state
    assert final.global_step == 4
    assert fake.names() == ["stop", "step", "start", "step", "snapshot", "stop", "step", "step"]


def test_in_the_loop_a_failing_step_aborts_without_writing(tmp_path):
    fake = FakeAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=3), Runtime(device=CUDA), allocator=fake)

    def step(state, batch):
        if state.global_step == 1:
            raise ValueError("bad batch")
        return {}

    plan = RunPlan(train_iters=4, steps_per_epoch=4, epochs=1)
    with pytest.raises(ValueError, match="bad batch"):
        train(TrainState(), step, [hook], data=lambda epoch, cursor: iter(range(cursor, 4)), plan=plan)
    assert fake.names() == ["stop", "start", "stop"]
    assert not (tmp_path / "snap").exists()


def test_in_the_loop_an_oom_step_writes_the_oom_snapshot(tmp_path):
    fake = ObservedAllocator()
    hook = memory_hook(memory_config(tmp_path, start_step=1, end_step=3), Runtime(device=CUDA), allocator=fake)

    def step(state, batch):
        fake.out_of_memory()
        raise torch.OutOfMemoryError("CUDA out of memory")

    plan = RunPlan(train_iters=4, steps_per_epoch=4, epochs=1)
    with pytest.raises(torch.OutOfMemoryError):
        train(TrainState(), step, [hook], data=lambda epoch, cursor: iter(range(cursor, 4)), plan=plan)
    assert snapshots(tmp_path / "snap") == ["snapshot_oom_0.pickle"]
    assert not fake.recording


# --- the tiny_gpt recipe ------------------------------------------------------------------------------


def _tiny_config(tmp_path, memory: MemoryConfig):
    import dataclasses

    from recipes import tiny_gpt

    train_config = dataclasses.replace(
        tiny_gpt.TrainConfig(), train_iters=2, global_batch_size=4, micro_batch_size=2
    )
    return tiny_gpt, tiny_gpt.Config(run_dir=str(tmp_path / "run"), train=train_config, memory=memory)


def test_recipe_enable_on_cpu_fails_before_the_model_is_built(tmp_path, monkeypatch):
    import fntrain.run.build as build
    import fntrain.run.job as job
    from fntrain.config import ConfigError

    tiny_gpt, cfg = _tiny_config(tmp_path, MemoryConfig(enable=True))
    monkeypatch.setattr(build, "build_job", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="cpu"):
        job.run_job(cfg, tiny_gpt.spec)


def test_recipe_puts_the_memory_hook_first_with_save_path_under_run_dir(tmp_path, monkeypatch):
    tiny_gpt, cfg = _tiny_config(tmp_path, MemoryConfig(mem_info=True))
    seen, built_hooks, hook_lists = [], [], []

    def spy(config, runtime, **kw):
        seen.append(config)
        built_hooks.append(memory_hook(config, runtime, **kw))
        return built_hooks[-1]

    import fntrain.hooks.standard as standard
    import fntrain.run.job as job
    from fntrain.run.job import run_job

    real_train = job.loop.train

    def spy_train(state, step_fn, hooks, **kw):
        hook_lists.append(list(hooks))
        return real_train(state, step_fn, hooks, **kw)

    monkeypatch.setattr(standard, "memory_hook", spy)
    monkeypatch.setattr(job.loop, "train", spy_train)
    with pytest.raises(ValueError, match="memory.end_step"):
        run_job(
            _tiny_config(tmp_path, MemoryConfig(start_step=3, end_step=1))[1], tiny_gpt.spec
        )  # the config's validate
    final = run_job(cfg, tiny_gpt.spec).state  # mem_info works on CPU (peak RSS)
    assert final.global_step == 2
    # built once, for the run itself (phase 1 checks its settings without building it)
    assert len(seen) == 1
    config = seen[-1]
    assert hook_lists[0][0] is built_hooks[-1]  # first in the list: its STEP_BEGIN precedes the others [S20]
    assert os.path.abspath(config.save_path) == str(tmp_path / "run" / "memory_snapshot")
    absolute = MemoryConfig(save_path=str(tmp_path / "elsewhere"), mem_info=True)
    standard.early_hooks(_tiny_config(tmp_path, absolute)[1], Runtime())
    assert seen[-1].save_path == str(tmp_path / "elsewhere")
