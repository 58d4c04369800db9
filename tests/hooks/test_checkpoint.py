"""Checkpoint hook [S36] [S19]: cadence, duplicates, restored steps, interrupts, preemption, async."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fntrain import RunPlan, StepInfo, StopTraining, TrainState, train
from fntrain.checkpoint import SaveTarget, find_latest, list_checkpoints, read_meta, restore, step_dir
from fntrain.checkpoint.layout import LATEST, checkpoint_root
from fntrain.hooks.base import hook_states, load_hook_states
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.hooks.signals import Preemption
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from tests.checkpoint import toy
from tests.helpers.checkpoints import saved_steps
from tests.hooks.drive import drive

INFO = StepInfo({"loss": 0.0})


def make_hook_and_parts(tmp_path, parts=None, **fields):
    config = CheckpointConfig(**fields)
    parts = parts or toy.components()
    hooks: list = []
    hook = checkpoint_hook(config, SaveTarget(tmp_path, parts, hooks=lambda: hooks, config={"k": 1}), Runtime())
    hooks.append(hook)
    return hook, parts


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("save_every", -1, ValueError, "checkpoint.save_every must be >= 0"),
        ("save_every", True, TypeError, "checkpoint.save_every must be an int"),
        ("keep_last", 1.5, TypeError, "checkpoint.keep_last"),
        ("async_save", 1, TypeError, "checkpoint.async_save must be a bool"),
        ("preempt_signals", ("SIGNOPE",), ValueError, "checkpoint.preempt_signals"),
        ("preempt_signals", ("SIGKILL",), ValueError, "cannot include SIGKILL"),
        ("preempt_check_every", 0, ValueError, "checkpoint.preempt_check_every"),
        ("restore_from", "", ValueError, "checkpoint.restore_from"),
        ("dir", "", ValueError, "checkpoint.dir"),
    ],
)
def test_config_errors_name_the_field(field, value, error, match):
    with pytest.raises(error, match=match):
        CheckpointConfig(**{field: value}).validate()


def test_checkpoint_root(tmp_path):
    assert checkpoint_root(CheckpointConfig(), tmp_path) == tmp_path / "checkpoints"
    assert checkpoint_root(CheckpointConfig(dir=str(tmp_path / "x")), "ignored") == tmp_path / "x"


def test_save_every_and_at_end_once(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=3)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 7, info=INFO, begin=False, end=None)
    assert saved_steps(tmp_path) == [3, 6]
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [3, 6, 7]
    meta = read_meta(step_dir(tmp_path, 7))
    assert meta["config"] == {"k": 1} and meta["train_state"]["global_step"] == 7


def test_end_save_skipped_when_last_step_was_saved(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=3)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 6, info=INFO, begin=False, end=None)
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [3, 6]


def test_save_epochs_and_no_duplicate_with_step_cadence(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=2, save_epochs=1, save_at_end=False, keep_last=0)  # every save kept
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    # epoch 0 ends at step 4, which save_every already saved
    state = drive(hook, 4, info=INFO, begin=False, end=None)
    hook(Event.EPOCH_END, state, None)
    state = drive(hook, 3, start=state.next_epoch(), info=INFO, begin=False, end=None)
    hook(Event.EPOCH_END, state, None)  # epoch 1 ends at step 7
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [2, 4, 6, 7]
    assert read_meta(step_dir(tmp_path, 7))["train_state"] == {"epoch": 1, "global_step": 7, "cursor": 3}


def test_disabled_by_default_saves_nothing(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert signal.getsignal(signal.SIGTERM) is before  # no handler without checkpointing
    state = drive(hook, 3, info=INFO, begin=False, end=None)
    hook(Event.EPOCH_END, state, None)
    hook(Event.TRAIN_END, state, None)
    assert not tmp_path.exists() or saved_steps(tmp_path) == []


def test_restored_step_is_not_saved_again(tmp_path):
    hook, parts = make_hook_and_parts(tmp_path, save_every=4)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    drive(hook, 4, info=INFO, begin=False, end=None)
    hook(Event.ABORT, TrainState(0, 4, 4), RuntimeError("crash"))

    resumed, _ = make_hook_and_parts(tmp_path, parts, save_every=4, save_epochs=1)
    state = restore("latest", parts, root=tmp_path, hooks=[resumed])
    assert state == TrainState(0, 4, 4) and resumed.state_dict() == {"last_saved_step": 4}
    mtime = os.stat(step_dir(tmp_path, 4) / "meta.json").st_mtime_ns
    resumed(Event.TRAIN_BEGIN, state, None)
    resumed(Event.EPOCH_END, state, None)  # a checkpoint taken at an epoch's end replays EPOCH_END [S12]
    resumed(Event.TRAIN_END, state, None)  # and a run restored at its last step ends at once
    assert saved_steps(tmp_path) == [4]
    assert os.stat(step_dir(tmp_path, 4) / "meta.json").st_mtime_ns == mtime


def test_restored_step_without_hook_state_is_not_saved_again(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=2)
    hook(Event.TRAIN_BEGIN, TrainState(0, 6, 6), None)
    hook(Event.TRAIN_END, TrainState(0, 6, 6), None)
    assert saved_steps(tmp_path) == []


def test_hook_state_round_trip():
    hook, _ = make_hook_and_parts("/unused", save_every=2)
    load_hook_states([hook], {"checkpoint": {"last_saved_step": 12}})
    assert hook_states([hook]) == {"checkpoint": {"last_saved_step": 12}}


def test_keep_last(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=1, keep_last=2)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 5, info=INFO, begin=False, end=None)
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [4, 5]
    assert (tmp_path / LATEST).read_text().strip() == "step_5"


def test_ctrl_c_inside_a_step_saves_at_the_next_boundary_and_stops_with_130(tmp_path):
    """Ctrl-C is a notice like SIGTERM: the handler only sets a flag, the step that was running completes,
    and the checkpoint at its boundary is a whole update; the outcome says "interrupted", exit 130."""
    hook, _ = make_hook_and_parts(tmp_path, save_every=10, save_on_interrupt=True)
    before = signal.getsignal(signal.SIGINT)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 2, info=INFO, begin=False, end=None)
    hook(Event.STEP_BEGIN, state, None)
    signal.raise_signal(signal.SIGINT)  # inside step 3: no KeyboardInterrupt, only the flag
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # a second Ctrl-C would end the process
    with pytest.raises(StopTraining) as caught:
        hook(Event.STEP_END, state.after_step(), INFO)
    assert (caught.value.outcome, caught.value.exit_code) == ("interrupted", 130)
    assert "SIGINT" in caught.value.reason and saved_steps(tmp_path) == [3]
    hook(Event.TRAIN_END, state.after_step(), None)
    assert signal.getsignal(signal.SIGINT) is before  # Python's KeyboardInterrupt handler is back


def test_ctrl_c_without_the_option_is_an_ordinary_interrupt(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=10)
    before = signal.getsignal(signal.SIGINT)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert signal.getsignal(signal.SIGINT) is before  # no handler: Ctrl-C raises KeyboardInterrupt
    hook(Event.ABORT, drive(hook, 2, info=INFO, begin=False, end=None), KeyboardInterrupt())
    assert saved_steps(tmp_path) == []


def test_ctrl_c_through_train_is_the_interrupted_outcome(tmp_path):
    hook, parts = make_hook_and_parts(tmp_path, save_every=10, save_on_interrupt=True)

    def interrupt_at_3(event, state, info):
        if event is Event.STEP_BEGIN and state.global_step == 2:
            signal.raise_signal(signal.SIGINT)

    result = train(
        TrainState(), lambda state, batch: {"loss": 0.0}, [interrupt_at_3, hook],
        data=lambda epoch, cursor: iter(range(100)), plan=RunPlan(train_iters=10, steps_per_epoch=10, epochs=1),
    )  # fmt: skip
    assert (result.outcome, result.exit_code, result.state.global_step) == ("interrupted", 130, 3)
    assert saved_steps(tmp_path) == [3]


def test_abort_before_train_begin_is_a_no_op(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=1, save_on_interrupt=True)
    hook(Event.ABORT, TrainState(0, 3, 3), KeyboardInterrupt())
    assert not tmp_path.exists() or saved_steps(tmp_path) == []


def test_preemption_signal_saves_at_the_step_boundary_and_stops(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=100)
    previous = signal.getsignal(signal.SIGUSR1)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 2, info=INFO, begin=False, end=None)
    hook(Event.STEP_BEGIN, state, None)
    signal.raise_signal(signal.SIGUSR1)  # arrives mid-step: only a flag is set
    assert saved_steps(tmp_path) == []
    with pytest.raises(StopTraining, match="preempted by SIGUSR1 at step 3") as caught:
        hook(Event.STEP_END, state.after_step(), INFO)
    assert caught.value.outcome == "preempted" and caught.value.exit_code == 143
    assert saved_steps(tmp_path) == [3]
    hook(Event.TRAIN_END, state.after_step(), None)
    assert saved_steps(tmp_path) == [3]  # not saved twice
    assert signal.getsignal(signal.SIGUSR1) is previous  # handlers removed


def test_preemption_through_train_ends_cleanly(tmp_path):
    parts = toy.components()
    data = toy.batches(6)
    hooks: list = []
    hooks.append(
        checkpoint_hook(CheckpointConfig(save_every=100, preempt_signals=("SIGUSR1",)), SaveTarget(tmp_path, parts, hooks=lambda: hooks), Runtime())
    )

    def step_fn(state, batch):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return {"loss": toy.step(parts, batch)}

    plan = RunPlan(train_iters=6, steps_per_epoch=6, epochs=1)
    final = train(TrainState(), step_fn, hooks, data=lambda epoch, cursor: iter(data[cursor:]), plan=plan).state
    assert final.global_step == 3 and saved_steps(tmp_path) == [3]


def test_preemption_is_the_outcome_of_train(tmp_path):
    """A requested preemption ends `train` with outcome "preempted", the configured exit code and
    a checkpoint of the step; nothing has to be read from a preemption object afterwards."""
    parts = toy.components()
    data = toy.batches(6)
    preemption = Preemption(("SIGUSR1",))
    hooks: list = []
    hooks.append(
        checkpoint_hook(CheckpointConfig(save_every=100, preempt_signals=("SIGUSR1",), preempt_exit_code=99), SaveTarget(tmp_path, parts, hooks=lambda: hooks), Runtime(), preemption=preemption)
    )

    def step_fn(state, batch):
        if state.global_step == 1:
            preemption.request()  # during step 2: the run stops after it
        return {"loss": toy.step(parts, batch)}

    plan = RunPlan(train_iters=6, steps_per_epoch=6, epochs=1)
    result = train(
        TrainState(), step_fn, hooks, data=lambda epoch, cursor: iter(data[cursor:]), plan=plan
    )
    assert result.outcome == "preempted" and result.exit_code == 99
    assert result.reason == "preempted by request at step 2" and result.state.global_step == 2
    assert saved_steps(tmp_path) == [2]
    assert read_meta(find_latest(tmp_path))["train_state"]["global_step"] == 2


def test_preemption_signal_through_train_exits_143(tmp_path):
    """The hook's own handlers (no injected preemption): a real SIGUSR1 gives outcome "preempted", exit
    code 143 by default; a run that is not preempted is "completed" with exit code 0."""
    parts = toy.components()
    data = toy.batches(4)
    previous = signal.getsignal(signal.SIGUSR1)

    def run(signal_at):
        hooks: list = []
        config = CheckpointConfig(save_every=100, preempt_signals=("SIGUSR1",), save_at_end=False)
        hooks.append(checkpoint_hook(config, SaveTarget(tmp_path, parts, hooks=lambda: hooks), Runtime()))

        def step_fn(state, batch):
            if state.global_step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return {"loss": toy.step(parts, batch)}

        plan = RunPlan(train_iters=4, steps_per_epoch=4, epochs=1)
        return train(
            TrainState(), step_fn, hooks, data=lambda e, cursor: iter(data[cursor:]), plan=plan
        )

    result = run(signal_at=3)
    assert (result.outcome, result.exit_code, result.state.global_step) == ("preempted", 143, 3)
    assert result.reason == "preempted by SIGUSR1 at step 3" and saved_steps(tmp_path) == [3]
    assert signal.getsignal(signal.SIGUSR1) is previous
    result = run(signal_at=None)
    assert (result.outcome, result.exit_code, result.state.global_step) == ("completed", 0, 4)


def test_train_loop_integration_resumes_exactly(tmp_path):
    """The hook inside `train`: a run stopped after step 4 and resumed from "latest" matches one run."""
    data = toy.batches(8)
    plan = RunPlan(train_iters=8, steps_per_epoch=8, epochs=1)

    def run(parts, state, stop_at=None):
        losses = {}
        hooks: list = []
        hooks.append(
            checkpoint_hook(CheckpointConfig(save_every=2), SaveTarget(tmp_path, parts, hooks=lambda: hooks), Runtime())
        )
        state = restore("latest", parts, root=tmp_path, hooks=hooks) if state is None else state

        def step_fn(state, batch):
            if state.global_step == stop_at:
                raise RuntimeError("crash")
            losses[state.global_step + 1] = toy.step(parts, batch)
            return {}

        try:
            train(state, step_fn, hooks, data=lambda epoch, cursor: iter(data[cursor:]), plan=plan)
        except RuntimeError:
            pass
        return losses

    torch.manual_seed(0)
    reference = toy.components()
    expected = run(reference, TrainState())
    for path in list_checkpoints(tmp_path):
        shutil.rmtree(path)
    (tmp_path / LATEST).unlink()
    torch.manual_seed(0)
    first = run(toy.components(), TrainState(), stop_at=5)
    assert find_latest(tmp_path) == step_dir(tmp_path, 4)
    resumed_parts = toy.components(seed=3)
    second = run(resumed_parts, None)
    assert {**first, **second} == expected and min(second) == 5
    assert toy.same_weights(reference, resumed_parts)


def test_async_saves_drain_at_train_end(tmp_path):
    hook, parts = make_hook_and_parts(tmp_path, save_every=2, async_save=True)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 5, info=INFO, begin=False, end=None)
    hook(Event.TRAIN_END, state, None)
    assert saved_steps(tmp_path) == [2, 4, 5]
    assert (tmp_path / LATEST).read_text().strip() == "step_5"


def test_failed_async_save_raises_at_the_next_step(tmp_path, monkeypatch):
    hook, _ = make_hook_and_parts(tmp_path, save_every=2, async_save=True)

    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    # step 2's save starts (and fails) in the background
    state = drive(hook, 2, info=INFO, begin=False, end=None)
    with pytest.raises(RuntimeError, match="checkpoint step_2 not saved"):
        for _ in range(200):  # it surfaces at the first step boundary after the failure is known
            hook(Event.STEP_BEGIN, state, None)
            state = state.after_step()
            hook(Event.STEP_END, state, INFO)
    hook(Event.ABORT, state, RuntimeError("from the loop"))  # and ABORT stays quiet afterwards
    assert saved_steps(tmp_path) == []


def test_abort_completes_a_pending_async_save(tmp_path):
    hook, _ = make_hook_and_parts(tmp_path, save_every=2, async_save=True)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    state = drive(hook, 2, info=INFO, begin=False, end=None)
    hook(Event.ABORT, state, RuntimeError("crash"))
    assert saved_steps(tmp_path) == [2]
