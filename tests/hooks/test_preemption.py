"""The preemption / time-based-save agreement on its own (one process): a notice is acted on at the next
step boundary, a timed save is due once the interval passed on the injected clock, and handlers live from
`begin()` to `end()`. The two-rank agreement is tests/checkpoint/test_time_based.py's."""

from __future__ import annotations

import signal

from fntrain import TrainState
from fntrain.hooks.preemption import Decision, make_agreement
from fntrain.hooks.signals import Preemption
from fntrain.runtime.runtime import Runtime


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_sets_preempt_at_the_next_boundary():
    preemption = Preemption(("SIGUSR1",))
    agreement = make_agreement(Runtime(), signals=("SIGUSR1",), preemption=preemption)
    agreement.begin()
    try:
        state = TrainState(0, 1, 1)
        assert agreement.decide(state) == Decision(preempt=False, save_due=False)
        preemption.request("test")
        assert agreement.decide(state.after_step()) == Decision(preempt=True, save_due=False)
        assert agreement.preemption is preemption and preemption.received == "test"
    finally:
        agreement.end()


def test_a_signal_sets_preempt_and_handlers_live_from_begin_to_end():
    previous = signal.getsignal(signal.SIGUSR1)
    agreement = make_agreement(Runtime(), signals=("SIGUSR1",))
    assert not agreement.preemption.installed  # nothing installed before begin()
    agreement.begin()
    assert agreement.preemption.installed
    signal.raise_signal(signal.SIGUSR1)  # only a flag: the decision comes at the boundary
    assert agreement.decide(TrainState(0, 1, 1)).preempt
    assert agreement.preemption.received == "SIGUSR1"
    agreement.end()
    assert signal.getsignal(signal.SIGUSR1) is previous and not agreement.preemption.installed


def test_time_is_due_after_the_interval_of_the_clock_and_restarts():
    clock = Clock()
    agreement = make_agreement(Runtime(), save_every_minutes=1.0, clock=clock)
    agreement.begin()  # the timer starts here
    state = TrainState(0, 1, 1)
    clock.now = 59.0
    assert agreement.decide(state) == Decision(False, False)
    clock.now = 60.0
    assert agreement.decide(state) == Decision(preempt=False, save_due=True)
    assert agreement.decide(state).save_due  # stays due until a save restarts the timer
    agreement.restart_timer()
    assert not agreement.decide(state).save_due
    clock.now = 120.0
    assert agreement.decide(state).save_due
    agreement.end()


def test_begin_restarts_the_timer():
    clock = Clock()
    agreement = make_agreement(Runtime(), save_every_minutes=0.5, clock=clock)
    clock.now = 1000.0
    agreement.begin()
    assert not agreement.decide(TrainState(0, 1, 1)).save_due
    clock.now = 1030.0
    assert agreement.decide(TrainState(0, 2, 2)).save_due
    agreement.end()


def test_nothing_watched_decides_nothing_and_installs_nothing():
    previous = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption(("SIGUSR1",))
    agreement = make_agreement(Runtime(), signals=(), preemption=preemption)
    agreement.begin()
    preemption.request()  # not watched: no preemption decision
    assert agreement.decide(TrainState(0, 1, 1)) == Decision()
    assert not preemption.installed and signal.getsignal(signal.SIGUSR1) is previous
    agreement.end()


def test_decisions_are_shared_values():
    """Deciding allocates nothing: each answer is one of four prebuilt values."""
    agreement = make_agreement(Runtime(), save_every_minutes=1.0, clock=Clock())
    agreement.begin()
    assert agreement.decide(TrainState(0, 1, 1)) is agreement.decide(TrainState(0, 2, 2))
    agreement.end()
