"""The loop's contracts: events and order, StepInfo, data lifetime, abort path, StopTraining, resume
[S10] [S12]-[S15] [S17] [S18] and DESIGN §Contracts. Plain Python: no torch needed."""

from __future__ import annotations

import pytest

from fntrain import Event, RunPlan, StepInfo, StopTraining, TrainState, train
from fntrain.hooks.base import every, hook_states, load_hook_states, on, on_ranks, stateful


class HookRecorder:
    """A hook that records (event, state, info)."""

    def __init__(self):
        self.calls = []

    def __call__(self, event, state, info):
        self.calls.append((event, state, info))

    def events(self):
        return [(e.name, s.epoch, s.global_step, s.cursor) for e, s, _ in self.calls]


class Data:
    """data(epoch, cursor) over `epochs` lists of batches; records opens and closes."""

    def __init__(self, per_epoch, short_epochs=None, fail_at=None):
        self.per_epoch = per_epoch
        self.short = short_epochs or {}
        self.fail_at = fail_at
        self.opened, self.closed = [], []

    def __call__(self, epoch, cursor):
        self.opened.append((epoch, cursor))
        data = self

        def gen():
            available = data.short.get(epoch, data.per_epoch)
            try:
                for k in range(cursor, available):
                    if data.fail_at == (epoch, k):
                        raise OSError("disk gone")
                    yield (epoch, k)
            finally:
                data.closed.append((epoch, cursor))

        return gen()


def run_loop(state=None, plan=None, step=None, hooks=(), data=None, **kw):
    plan = plan or RunPlan(train_iters=5, steps_per_epoch=3, epochs=2)
    data = data or Data(3)
    seen = []

    def default_step(state, batch):
        seen.append(batch)
        return {"loss": 1.0}

    final = train(state or TrainState(), step or default_step, list(hooks), data=data, plan=plan, **kw).state
    return final, seen, data


def test_event_order_over_two_epochs():
    rec = HookRecorder()
    final, seen, _ = run_loop(hooks=[rec])
    assert final == TrainState(epoch=1, global_step=5, cursor=2)
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert rec.events() == [
        ("TRAIN_BEGIN", 0, 0, 0),
        ("EPOCH_BEGIN", 0, 0, 0),
        ("STEP_BEGIN", 0, 0, 0), ("STEP_END", 0, 1, 1),
        ("STEP_BEGIN", 0, 1, 1), ("STEP_END", 0, 2, 2),
        ("STEP_BEGIN", 0, 2, 2), ("STEP_END", 0, 3, 3),
        ("EPOCH_END", 0, 3, 3),
        ("EPOCH_BEGIN", 1, 3, 0),
        ("STEP_BEGIN", 1, 3, 0), ("STEP_END", 1, 4, 1),
        ("STEP_BEGIN", 1, 4, 1), ("STEP_END", 1, 5, 2),
        ("TRAIN_END", 1, 5, 2),
    ]  # fmt: skip


def test_hooks_run_in_list_order_and_step_end_gets_step_info():
    order = []
    first = lambda e, s, i: order.append(("first", e))  # noqa: E731
    second = lambda e, s, i: order.append(("second", e))  # noqa: E731
    rec = HookRecorder()
    run_loop(hooks=[first, second, rec], count_batch=lambda batch: (7, 2), clock=iter(range(100)).__next__)
    assert order[:2] == [("first", Event.TRAIN_BEGIN), ("second", Event.TRAIN_BEGIN)]
    infos = [i for e, _, i in rec.calls if e is Event.STEP_END]
    assert all(isinstance(i, StepInfo) for i in infos)
    assert infos[0].metrics == {"loss": 1.0} and infos[0].tokens == 7 and infos[0].samples == 2
    assert infos[0].step_time_s == 1  # two clock reads around the step
    assert all(i is None for e, _, i in rec.calls if e is not Event.STEP_END)


def test_metrics_pass_through_untouched():
    sentinel = object()
    rec = HookRecorder()
    run_loop(step=lambda s, b: {"loss": sentinel}, hooks=[rec])
    assert next(i for e, _, i in rec.calls if e is Event.STEP_END).metrics["loss"] is sentinel


def test_out_of_data_ends_epoch_without_advancing_or_dangling_step_begin():
    rec = HookRecorder()
    data = Data(3, short_epochs={0: 2})
    final, seen, _ = run_loop(hooks=[rec], data=data)
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert final == TrainState(epoch=2, global_step=5, cursor=0)  # epoch 1 completed all 3 steps
    names = [c[0] for c in rec.events()]
    assert names.count("STEP_BEGIN") == names.count("STEP_END") == 5
    epoch0_end = rec.events().index(("EPOCH_END", 0, 2, 2))
    assert rec.events()[epoch0_end - 1] == ("STEP_END", 0, 2, 2)
    assert data.opened == data.closed == [(0, 0), (1, 0)]


def test_empty_epoch_from_the_start_is_an_error_not_an_endless_loop():
    rec = HookRecorder()
    with pytest.raises(RuntimeError, match="yielded no batch"):
        run_loop(hooks=[rec], data=Data(0))
    assert rec.calls[-1][0] is Event.ABORT


@pytest.mark.parametrize("where", ["step", "hook", "data"])
def test_failure_aborts_every_hook_closes_data_and_reraises_same_object(where):
    error = ValueError("boom")
    rec, late = HookRecorder(), HookRecorder()

    def step(state, batch):
        if where == "step" and state.global_step == 1:
            raise error
        return {"loss": 0.0}

    def bad_hook(event, state, info):
        if where == "hook" and event is Event.STEP_END and state.global_step == 2:
            raise error

    data = Data(3, fail_at=(0, 1) if where == "data" else None)
    with pytest.raises(BaseException) as caught:
        run_loop(step=step, hooks=[rec, bad_hook, late], data=data)
    if where == "data":
        assert isinstance(caught.value, OSError)
    else:
        assert caught.value is error
    for hook in (rec, late):
        events = [e for e, _, _ in hook.calls]
        assert events[-1] is Event.ABORT and Event.TRAIN_END not in events
        assert hook.calls[-1][2] is caught.value
    assert data.closed == data.opened  # the epoch's iterator was closed


def test_abort_reaches_hook_whose_train_begin_failed_and_hook_errors_do_not_hide_original():
    original = KeyError("begin failed")
    rec = HookRecorder()

    def fails_at_begin(event, state, info):
        if event is Event.TRAIN_BEGIN:
            raise original
        if event is Event.ABORT:
            raise RuntimeError("abort handler broke")

    with pytest.raises(KeyError) as caught:
        run_loop(hooks=[fails_at_begin, rec])
    assert caught.value is original
    assert [e for e, _, _ in rec.calls] == [Event.ABORT]  # never began, still told


def test_keyboard_interrupt_is_a_failure_like_any_other():
    rec = HookRecorder()

    def step(state, batch):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_loop(step=step, hooks=[rec])
    assert rec.calls[-1][0] is Event.ABORT and isinstance(rec.calls[-1][2], KeyboardInterrupt)


def test_stop_training_ends_cleanly_with_train_end():
    rec = HookRecorder()

    def stopper(event, state, info):
        if event is Event.STEP_END and state.global_step == 2:
            raise StopTraining

    final, seen, data = run_loop(hooks=[stopper, rec])
    assert final.global_step == 2
    assert rec.calls[-1][0] is Event.TRAIN_END
    assert Event.ABORT not in [e for e, _, _ in rec.calls]
    assert data.closed == data.opened


def test_epoch_end_sees_finished_epoch_and_counter_advances_after():
    seen_epochs = []
    hook = on(Event.EPOCH_END, lambda s, i: seen_epochs.append(s.epoch))
    final, _, _ = run_loop(plan=RunPlan(train_iters=6, steps_per_epoch=3, epochs=2), hooks=[hook])
    assert seen_epochs == [0, 1]
    assert final == TrainState(epoch=2, global_step=6, cursor=0)


def collect(state, plan, per_epoch=3):
    rec = HookRecorder()
    final, seen, _ = run_loop(state=state, plan=plan, hooks=[rec], data=Data(per_epoch))
    return final, seen, rec


@pytest.mark.parametrize("stop_after", range(0, 8))
def test_resume_from_any_state_sees_exactly_the_remaining_batches(stop_after):
    plan = RunPlan(train_iters=8, steps_per_epoch=3, epochs=3)
    _, full, full_rec = collect(TrainState(), plan)
    # The state an uninterrupted run had after `stop_after` steps (as a checkpoint saved at STEP_END).
    step_ends = [s for e, s, _ in full_rec.calls if e is Event.STEP_END]
    resume_state = step_ends[stop_after - 1] if stop_after else TrainState()
    final, tail, rec = collect(resume_state, plan)
    assert tail == full[stop_after:]
    assert final.global_step == 8


def test_resume_with_cursor_at_end_of_epoch_fires_epoch_end_then_moves_on():
    plan = RunPlan(train_iters=5, steps_per_epoch=3, epochs=2)
    final, seen, rec = collect(TrainState(epoch=0, global_step=3, cursor=3), plan)
    assert seen == [(1, 0), (1, 1)]
    assert rec.events()[:3] == [("TRAIN_BEGIN", 0, 3, 3), ("EPOCH_END", 0, 3, 3), ("EPOCH_BEGIN", 1, 3, 0)]


def test_already_finished_state_runs_nothing():
    plan = RunPlan(train_iters=3, steps_per_epoch=3, epochs=1)
    final, seen, rec = collect(TrainState(epoch=1, global_step=3, cursor=0), plan)
    assert seen == [] and [c[0] for c in rec.events()] == ["TRAIN_BEGIN", "TRAIN_END"]


# ------------------------------------------------------------------ combinators and hook state


def test_every_gates_step_events_only():
    rec = HookRecorder()
    run_loop(plan=RunPlan(train_iters=6, steps_per_epoch=6, epochs=1), data=Data(6), hooks=[every(3, rec)])
    steps = [(e.name, s.global_step) for e, s, _ in rec.calls if e in (Event.STEP_BEGIN, Event.STEP_END)]
    assert steps == [("STEP_BEGIN", 2), ("STEP_END", 3), ("STEP_BEGIN", 5), ("STEP_END", 6)]
    assert rec.calls[0][0] is Event.TRAIN_BEGIN and rec.calls[-1][0] is Event.TRAIN_END
    with pytest.raises(ValueError, match="every"):
        every(0, rec)


def test_on_ranks_selects_and_keeps_state_protocol():
    rec = HookRecorder()
    assert on_ranks({0}, 0, rec) is rec
    skipped = on_ranks({0}, 1, rec)
    skipped(Event.TRAIN_BEGIN, TrainState(), None)
    assert rec.calls == []


def test_stateful_hooks_round_trip_through_combinators():
    counter = {"n": 0}

    def count(event, state, info):
        if event is Event.STEP_END:
            counter["n"] += 1

    hook = stateful("counter", count, lambda: dict(counter), lambda d: counter.update(d))
    gated = every(2, hook)
    run_loop(hooks=[gated])
    assert counter["n"] == 2  # steps 2 and 4 of 5
    saved = hook_states([gated, HookRecorder()])
    assert saved == {"counter": {"n": 2}}
    counter["n"] = 0
    assert load_hook_states([gated], saved) == []
    assert counter["n"] == 2
    assert load_hook_states([gated], {}) == ["counter"]
    with pytest.raises(ValueError, match="share the state name"):
        hook_states([hook, gated])
