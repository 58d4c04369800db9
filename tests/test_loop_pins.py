"""Behaviours of `train` that mutation testing found unpinned (mutation/RESULTS.md): what StepInfo
carries, what a StopTraining turns into, when each data iterator is closed, the state ABORT hooks see,
and the log lines a user reads when a run stops, runs out of data or a hook fails during ABORT."""

from __future__ import annotations

import logging

import pytest

from fntrain import Event, RunPlan, StepInfo, StopTraining, TrainState, train

PLAN = RunPlan(train_iters=5, steps_per_epoch=3, epochs=2)


class Batches:
    """One epoch's batches as an iterator with an explicit close() (not a generator, so nothing but
    `close()` closes it), logging each close into the shared `events` list."""

    def __init__(self, epoch, cursor, n, events):
        self.items = iter([(epoch, k) for k in range(cursor, n)])
        self.events, self.epoch = events, epoch

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)

    def close(self):
        self.events.append(("CLOSE", self.epoch))


def recorded_run(hooks=(), n=3, plan=PLAN, **kw):
    events = []
    hooks = [lambda e, s, i: events.append((e.name, s.global_step)), *hooks]
    result = train(TrainState(), lambda s, b: {"loss": 1.0}, hooks,
                   data=lambda epoch, cursor: Batches(epoch, cursor, n, events), plan=plan, **kw)
    return result, events


def test_each_epoch_iterator_is_closed_before_epoch_end_and_train_end():
    _, events = recorded_run()
    assert events.index(("CLOSE", 0)) == events.index(("EPOCH_END", 3)) - 1
    assert events.index(("CLOSE", 1)) == events.index(("TRAIN_END", 5)) - 1


def test_stop_training_mid_epoch_closes_the_data_before_train_end_and_reports_why(caplog):
    def stopper(event, state, info):
        if event is Event.STEP_END and state.global_step == 2:
            raise StopTraining("enough", outcome="preempted", exit_code=75)

    with caplog.at_level(logging.INFO, logger="fntrain.loop"):
        result, events = recorded_run(hooks=[stopper])
    assert events[-2:] == [("CLOSE", 0), ("TRAIN_END", 2)]
    assert (result.outcome, result.reason, result.exit_code) == ("preempted", "enough", 75)
    assert result.state == TrainState(epoch=0, global_step=2, cursor=2)
    assert "StopTraining at global_step 2; ending the run" in caplog.messages


def test_stop_training_defaults_and_message():
    stop = StopTraining()
    assert (stop.reason, stop.outcome, stop.exit_code, str(stop)) == ("", "stopped", 0, "")
    assert str(StopTraining("user asked")) == "user asked"

    def stopper(event, state, info):
        if event is Event.STEP_END:
            raise StopTraining()

    result, _ = recorded_run(hooks=[stopper])
    assert (result.outcome, result.reason, result.exit_code) == ("stopped", "", 0)


def test_step_info_without_count_batch_has_zero_counts_and_the_step_wall_time():
    infos = []
    ticks = iter([10.0, 10.25, 20.0, 20.5, 30.0, 31.0, 40.0, 40.0, 50.0, 52.0])
    recorded_run(hooks=[lambda e, s, i: infos.append(i) if e is Event.STEP_END else None],
                 clock=ticks.__next__)
    assert [(i.tokens, i.samples) for i in infos] == [(0, 0)] * 5
    assert [i.step_time_s for i in infos] == [0.25, 0.5, 1.0, 0.0, 2.0]


def test_count_batch_sees_each_batch():
    counted, infos = [], []

    def count(batch):
        counted.append(batch)
        return batch[1] + 100, batch[0]

    recorded_run(hooks=[lambda e, s, i: infos.append(i) if e is Event.STEP_END else None], count_batch=count)
    assert counted == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert [(i.tokens, i.samples) for i in infos] == [(100, 0), (101, 0), (102, 0), (100, 1), (101, 1)]
    assert StepInfo({}) == StepInfo({}, 0, 0, 0.0)


def test_data_without_close_method_is_fine():
    result = train(TrainState(), lambda s, b: {}, [], data=lambda e, c: iter(range(c, 3)), plan=PLAN)
    assert result.state.global_step == 5


def test_abort_hooks_see_the_latest_state_and_failures_are_logged(caplog):
    seen = []

    def watcher(event, state, info):
        if event is Event.ABORT:
            seen.append((state, info))

    def broken_abort(event, state, info):
        if event is Event.STEP_END and state.global_step == 4:
            raise KeyError("step four")
        if event is Event.ABORT:
            raise ValueError("abort hook broke")

    class BadClose(Batches):
        def close(self):  # epoch 1's iterator is open when step 4 fails
            if self.epoch == 1:
                raise OSError("close broke")

    with caplog.at_level(logging.ERROR, logger="fntrain.loop"), pytest.raises(KeyError) as raised:
        train(TrainState(), lambda s, b: {}, [broken_abort, watcher],
              data=lambda e, c: BadClose(e, c, 3, []), plan=PLAN)
    assert seen == [(TrainState(epoch=1, global_step=4, cursor=1), raised.value)]
    assert caplog.messages == [
        f"hook {broken_abort!r} raised during ABORT: {ValueError('abort hook broke')!r}",
        f"closing the data iterator during ABORT raised: {OSError('close broke')!r}",
    ]


def test_running_out_of_data_is_logged_with_epoch_cursor_and_length(caplog):
    with caplog.at_level(logging.INFO, logger="fntrain.loop"):
        result, _ = recorded_run(n=2)
    assert result.state.global_step == 5
    assert caplog.messages == [  # the steps of the epoch (its cursor), not of the run
        "epoch 0 ran out of data after 2 of 3 steps; ending the epoch",
        "epoch 1 ran out of data after 2 of 3 steps; ending the epoch",
    ]


def test_data_that_ends_at_a_resumed_cursor_ends_the_epoch_quietly(caplog):
    """Resumed at cursor 2 of a 4-step epoch whose data holds only 2 batches: the epoch ends there (no
    'empty epoch' error: that is for an epoch that yields nothing from its start) and the run goes on."""
    plan = RunPlan(train_iters=6, steps_per_epoch=4, epochs=3)
    events = []
    with caplog.at_level(logging.INFO, logger="fntrain.loop"):
        result = train(TrainState(epoch=0, global_step=2, cursor=2), lambda s, b: {"loss": 1.0}, [],
                       data=lambda epoch, cursor: Batches(epoch, cursor, 2, events), plan=plan)  # fmt: skip
    assert result.state == TrainState(epoch=2, global_step=6, cursor=2)  # epoch 2 reaches train_iters
    assert caplog.messages == [
        f"epoch {epoch} ran out of data after 2 of 4 steps; ending the epoch" for epoch in (0, 1)
    ]
