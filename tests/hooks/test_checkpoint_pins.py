"""Behaviours of the checkpoint hook (`fntrain.hooks.checkpoint`) that mutation testing found unpinned
(mutation/RESULTS.md): the time-based save (its log line, its clock, temporary and background saves), the
preemption stop (its warning, a synchronous save that always stops on failure, the reason naming the step
the notice arrived during), the final save being synchronous, a failed background save surfacing at the
exact boundary after it is known, ABORT waiting no longer than abort_wait_s, the hook state of a fresh or
an older checkpoint, the SaveOptions and RNG device the hook passes on (writer threads, make_room, the
runtime's device), the dedicated gloo group of multi-rank async saves, and that nothing is saved after
TRAIN_END or ABORT."""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fntrain.checkpoint import CheckpointSaveError, SaveTarget, close_async_saves, is_temporary, step_dir
from fntrain.hooks.base import hook_states, load_hook_states
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.hooks.signals import Preemption
from fntrain.loop import Event, StopTraining
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.checkpoint import toy
from tests.checkpoint.test_time_based import timed_saves as run_timed
from tests.helpers.checkpoints import bytes_under, fake_disk_capacity, saved_steps
from tests.hooks.drive import drive
from tests.hooks.test_checkpoint_edges import held_writes, make_hook  # noqa: F401 (held_writes: a fixture)

HOOK_LOG = "fntrain.hooks.checkpoint"


def hook_with(tmp_path, runtime=None, preemption=None, restoring=False, **fields):
    """The hook with a given runtime, injected preemption or `restoring` (`make_hook` uses the defaults)."""
    hooks: list = []
    target = SaveTarget(tmp_path, toy.components(), hooks=lambda: hooks)
    config = CheckpointConfig(**fields)
    hooks.append(
        checkpoint_hook(config, target, runtime or Runtime(), restoring=restoring, preemption=preemption)
    )
    return hooks[0]


def hook_messages(caplog, logger=HOOK_LOG) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == logger]


# -- time-based saves ---------------------------------------------------------------------------------


def test_time_based_saves_follow_the_injected_clock_and_say_why(tmp_path, caplog):
    # 25 s steps, 0.5 minutes: due at steps 2, 4, 6 (each 50 s after the last save); never by the wall clock.
    with caplog.at_level(logging.INFO, logger=HOOK_LOG):
        assert run_timed(tmp_path, 6, save_every_minutes=0.5, save_at_end=False) == [2, 4, 6]
    assert hook_messages(caplog).count("0.5 minutes since the last checkpoint: saving") == 3
    assert not is_temporary(step_dir(tmp_path, 6))


def test_a_temporary_time_based_checkpoint_says_so(tmp_path):
    assert run_timed(tmp_path, 2, save_every_minutes=0.5, time_based_temporary=True, save_at_end=False) == [2]
    assert is_temporary(step_dir(tmp_path, 2))


def test_with_async_save_a_time_based_save_is_written_in_the_background(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=HOOK_LOG):
        assert run_timed(tmp_path, 2, save_every_minutes=0.5, async_save=True, save_at_end=False) == [2]
    assert any(m.startswith("checkpoint step 2 staged in") for m in hook_messages(caplog))


# -- preemption --------------------------------------------------------------------------------------


def test_a_preemption_warns_and_saves_synchronously_even_with_async_save(tmp_path, caplog):
    preemption = Preemption(("SIGUSR1",))
    hook = hook_with(tmp_path, preemption=preemption, save_every=100, async_save=True, preempt_exit_code=99)
    state = drive(hook, 1, end=None)
    hook(Event.STEP_BEGIN, state, None)
    preemption.request()
    with caplog.at_level(logging.INFO, logger=HOOK_LOG), pytest.raises(StopTraining):
        hook(Event.STEP_END, state.after_step(), None)
    hook(Event.TRAIN_END, state.after_step(), None)
    lines = hook_messages(caplog)
    assert lines[0] == "preemption (request): saving step 2 and stopping (exit status 99)"
    assert lines[1].startswith("checkpoint step 2 saved in") and saved_steps(tmp_path) == [2]


@pytest.fixture
def failing_writes(monkeypatch):
    """Every DCP write fails with OSError("disk full") once the returned event is set (set it at once
    for a failure as soon as the write starts)."""
    gate = threading.Event()

    def fails(self, plan, planner):
        assert gate.wait(60), "the test never released the write"
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fails)
    yield gate
    gate.set()
    assert close_async_saves(timeout=30)


@pytest.mark.parametrize("async_save", [False, True], ids=["its_own_save", "the_async_save_of_that_step"])
def test_a_preemption_whose_checkpoint_fails_stops_with_the_failure_even_with_continue(
    tmp_path, failing_writes, async_save
):
    """on_save_failure continue does not apply to a preemption's checkpoint: the run ends with the save's
    line (exit status 1, resumable from the newest good checkpoint), not as "preempted" without one."""
    failing_writes.set()
    preemption = Preemption(("SIGUSR1",))
    hook = hook_with(tmp_path, preemption=preemption, save_every=2 if async_save else 100,
                     async_save=async_save, on_save_failure="continue")  # fmt: skip
    state = drive(hook, 1, end=None)
    hook(Event.STEP_BEGIN, state, None)
    preemption.request()
    with pytest.raises(CheckpointSaveError, match="^checkpoint step_2 not saved: disk full"):
        hook(Event.STEP_END, state.after_step(), None)
    hook(Event.ABORT, state.after_step(), RuntimeError("stopped"))
    assert saved_steps(tmp_path) == []



def test_ranks_stop_at_the_agreed_step_and_the_reason_names_the_step_the_notice_came(
    tmp_path, one_rank_group
):
    preemption = Preemption(("SIGUSR1",))
    runtime = Runtime(world_size=2, backend="gloo")
    hook = hook_with(tmp_path / "ckpt", runtime, preemption, save_every=100, preempt_check_every=3)
    state = drive(hook, 0, end=None)
    preemption.request()  # seen at the end of step 1; steps 1 and 2 are not agreement steps
    with pytest.raises(StopTraining) as stop:
        drive(hook, 3, start=state, begin=False, end=None)
    hook(Event.TRAIN_END, TrainState(0, 3, 3), None)
    assert stop.value.reason == ("preempted by request at step 3 (received during step 1; the ranks stop "
                                 "together every --checkpoint.preempt-check-every steps)")  # fmt: skip
    assert saved_steps(tmp_path / "ckpt") == [3]


# -- multi-rank async saves: one dedicated gloo group -------------------------------------------------


@pytest.fixture
def created_groups(monkeypatch):
    """The (backend, timeout) of every group `dist.new_group` creates (the groups are real)."""
    created = []
    real = dist.new_group

    def recording(*args, **kwargs):
        created.append((kwargs.get("backend"), kwargs.get("timeout")))
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording)
    return created


@pytest.mark.parametrize(
    ("world_size", "backend", "async_save", "groups"),
    [
        (2, "gloo", True, 1),
        (2, "nccl", True, 1),
        (1, "gloo", True, 0),
        (2, None, True, 0),
        (2, "gloo", False, 0),
    ],
)
def test_multi_rank_async_saves_get_one_gloo_group_with_the_runs_timeout(
    tmp_path, one_rank_group, created_groups, world_size, backend, async_save, groups
):
    runtime = Runtime(world_size=world_size, backend=backend)
    hook = hook_with(tmp_path, runtime, async_save=async_save, preempt_signals=())
    for _ in range(2):  # a hook driven through two runs makes its group once
        drive(hook, 0)
    assert created_groups == [("gloo", datetime.timedelta(seconds=77))] * groups


# -- the final save, background failures, ABORT -------------------------------------------------------


def test_a_failing_final_save_fails_train_end_even_with_async_save(tmp_path, failing_writes):
    failing_writes.set()
    hook = make_hook(tmp_path, save_every=10, async_save=True)
    state = drive(hook, 3, end=None)
    with pytest.raises(CheckpointSaveError, match="^checkpoint step_3 not saved: disk full"):
        hook(Event.TRAIN_END, state, None)


@pytest.mark.parametrize("known", ["between_steps", "during_the_step"])
@pytest.mark.parametrize("on_save_failure", ["stop", "continue"])
def test_a_failed_background_save_surfaces_at_the_first_boundary_after_it_is_known(
    tmp_path, failing_writes, caplog, known, on_save_failure
):
    """Known between steps: at STEP_BEGIN; known during a step: at its STEP_END. "stop" raises the save's
    line there, "continue" warns there and the next cadence saves."""
    hook = make_hook(tmp_path, save_every=2, async_save=True, on_save_failure=on_save_failure)
    state = drive(hook, 2, end=None)  # step 2's write is held
    boundary = Event.STEP_BEGIN if known == "between_steps" else Event.STEP_END
    if boundary is Event.STEP_END:
        hook(Event.STEP_BEGIN, state, None)
    failing_writes.set()
    assert close_async_saves(timeout=30)  # the write has failed: the hook has not looked yet
    at = state if boundary is Event.STEP_BEGIN else state.after_step()
    line = "checkpoint step_2 not saved: disk full"
    with caplog.at_level(logging.WARNING, logger=HOOK_LOG):
        try:
            hook(boundary, at, None)
        except CheckpointSaveError as error:
            raised = error.line
        else:
            raised = None
        finally:
            hook(Event.ABORT, at, RuntimeError("end"))
    if on_save_failure == "stop":
        assert raised.startswith(line) and hook_messages(caplog) == []
    else:
        [warning] = hook_messages(caplog)
        assert (
            raised is None
            and warning.startswith(line)
            and warning.endswith(
                "; training goes on (checkpoint.on_save_failure continue), the next save tries again"
            )
        )


def test_abort_waits_no_longer_than_abort_wait_s(tmp_path, held_writes, caplog):  # noqa: F811
    hook = make_hook(tmp_path, save_every=2, async_save=True, abort_wait_s=0.1)
    state = drive(hook, 2, end=None)  # step 2's write is held until well after abort_wait_s
    timer = threading.Timer(2.0, held_writes.set)
    timer.start()
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="fntrain.checkpoint"):
        hook(Event.ABORT, state, RuntimeError("crash"))
    waited = time.monotonic() - started
    assert saved_steps(tmp_path) == [] and waited < 1.5
    timer.cancel()
    assert any("still running after 0 s; abandoning it" in m for m in hook_messages(caplog, "fntrain.checkpoint"))


@pytest.mark.parametrize("end", [Event.TRAIN_END, Event.ABORT])
def test_nothing_is_saved_after_train_end_or_abort(tmp_path, end):
    hook = make_hook(tmp_path, save_every=1, save_epochs=1, save_at_end=False)
    state = drive(hook, 2, end=end)
    drive(hook, 2, start=state, begin=False, end=None, epoch_events=True)  # stray events: ignored
    assert saved_steps(tmp_path) == [1, 2]


# -- the hook state -----------------------------------------------------------------------------------


def test_a_fresh_run_has_saved_nothing_and_an_older_checkpoints_state_loads_as_nothing_saved(tmp_path):
    fresh = make_hook(tmp_path, save_every=1)
    drive(fresh, 0)
    assert hook_states([fresh]) == {"checkpoint": {"last_saved_step": -1}}
    older = make_hook(tmp_path, save_every=1)
    load_hook_states([older], {"checkpoint": {}})  # a checkpoint written before the key existed
    assert hook_states([older]) == {"checkpoint": {"last_saved_step": -1}}
    drive(older, 1)
    assert saved_steps(tmp_path) == [1]


@pytest.mark.parametrize("step", [1, 5])
def test_the_step_a_run_starts_at_is_not_saved_again(tmp_path, step):
    hook = make_hook(tmp_path, save_every=1)
    drive(hook, 0, start=TrainState(0, step, step))  # TRAIN_BEGIN, TRAIN_END at once
    assert saved_steps(tmp_path) == []


@pytest.mark.parametrize(("restoring", "expected"), [(True, [6]), (False, [])])
def test_a_restoring_run_without_a_cadence_checkpoints_its_new_end(tmp_path, restoring, expected):
    """A run extended from a checkpoint (train_iters raised, no cadence set) ends with a checkpoint."""
    drive(hook_with(tmp_path, restoring=restoring), 2, start=TrainState(0, 4, 4))
    assert saved_steps(tmp_path) == expected


def test_a_run_started_at_a_restored_step_completes_its_async_saves(tmp_path):
    hook = make_hook(tmp_path, save_every=2, async_save=True)
    drive(hook, 4, start=TrainState(0, 4, 4))
    assert saved_steps(tmp_path) == [6, 8]


# -- what the hook passes to the saver -----------------------------------------------------------------


def test_thread_count_is_the_number_of_data_files_per_rank(tmp_path):
    drive(make_hook(tmp_path, save_every=1, thread_count=2), 1)
    assert len(list(step_dir(tmp_path, 1).glob("*.distcp"))) == 2


def test_make_room_lets_a_save_that_would_not_fit_replace_the_oldest(tmp_path, monkeypatch):
    hook = make_hook(tmp_path, save_every=1, keep_last=2, make_room=True)
    state = drive(hook, 1, end=None)
    fake_disk_capacity(monkeypatch, tmp_path, int(bytes_under(step_dir(tmp_path, 1)) * 2.5))  # room for step 3 once 1 goes
    drive(hook, 2, start=state, begin=False)
    assert saved_steps(tmp_path) == [2, 3]


def test_the_rng_state_saved_is_the_runtime_devices_not_the_models(tmp_path, monkeypatch):
    """A model kept on the CPU (e.g. offloaded) in a run on an accelerator: the checkpoint holds that
    accelerator's generator (a fake one here: tests need no GPU)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda index: torch.arange(4, dtype=torch.uint8))
    drive(hook_with(tmp_path, Runtime(device=torch.device("cuda")), save_every=1), 1)
    rng = json.loads((step_dir(tmp_path, 1) / "rank_0.json").read_text())["rng"]
    assert rng["device"]["type"] == "cuda"
