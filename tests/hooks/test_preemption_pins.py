"""Behaviours of the preemption / time-based-save agreement that mutation testing found unpinned
(mutation/RESULTS.md): which runs agree through a collective (several ranks with a process group) and
which decide alone at every step; the warning a notice gives says where the save happens (the check
interval, 10 by default); only the configured signals (and Ctrl-C when asked) are caught; a notice on any
rank stops every rank at the next agreed step while the timed save is rank 0's; the step of the first
notice is kept; the flags stay on the CPU whatever torch's default device; a device backend gets one gloo
group of its own with the run's timeout, a gloo backend none, and no gloo group is one exact warning.

The other ranks are a fake `all_reduce` that adds their flags with the reduction it is given."""

from __future__ import annotations

import datetime
import logging
import signal

import pytest
import torch
import torch.distributed as dist

from fntrain.hooks.preemption import Decision, make_agreement
from fntrain.hooks.signals import Preemption
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.hooks.test_preemption import Clock

TWO_RANKS = Runtime(world_size=2, backend="gloo")
_REDUCTIONS = {dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.SUM: torch.add}


class PeerRanks:
    """Stands in for the collective: the flags [preempt, time due] each other rank sends, reduced into
    this rank's tensor with the given op (torch's defaults otherwise); records each call's group."""

    def __init__(self, *flags: tuple[int, int]) -> None:
        self.flags, self.groups = flags, []

    def __call__(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.groups.append(group)
        for other in self.flags:
            tensor.copy_(
                _REDUCTIONS[op](tensor, torch.tensor(other, dtype=tensor.dtype, device=tensor.device))
            )


class NewGroups:
    """Stands in for `dist.new_group`: records how each group was asked for and returns a token."""

    def __init__(self) -> None:
        self.made: list[dict] = []

    def __call__(self, **kwargs):
        self.made.append(kwargs)
        return f"group {len(self.made)}"


@pytest.fixture
def other_ranks(monkeypatch):
    def install(*flags):
        fake = PeerRanks(*flags)
        monkeypatch.setattr(dist, "all_reduce", fake)
        return fake

    return install


@pytest.fixture
def fake_new_groups(monkeypatch):
    fake = NewGroups()
    monkeypatch.setattr(dist, "new_group", fake)
    return fake


def first_preempted_step(agreement, steps) -> int | None:
    for step in steps:
        if agreement.decide(TrainState(0, step, step)).preempt:
            return step
    return None


@pytest.mark.parametrize(
    ("runtime", "stops_at", "collectives"),
    [
        (Runtime(), 5, 0),
        (Runtime(world_size=1, backend="gloo"), 5, 0),  # one rank with a process group: nobody to agree with
        (Runtime(world_size=2), 5, 0),  # no process group: no collective to run
        (TWO_RANKS, 8, 1),  # several ranks: only at the agreed steps, one collective each
        (Runtime(world_size=3, rank=2, backend="gloo"), 8, 1),
    ],
)
def test_only_several_ranks_with_a_process_group_wait_for_the_agreed_step(
    other_ranks, runtime, stops_at, collectives
):
    reduce = other_ranks((0, 0))
    preemption = Preemption(("SIGUSR1",))
    agreement = make_agreement(runtime, signals=("SIGUSR1",), check_every=4, preemption=preemption)
    preemption.request("SIGUSR1")  # arrives during step 5
    assert first_preempted_step(agreement, range(5, 10)) == stops_at
    assert len(reduce.groups) == collectives


@pytest.mark.parametrize(
    ("runtime", "check_every", "where"),
    [
        (Runtime(), None, "at the next step boundary"),
        (Runtime(), 4, "at the next step boundary"),
        (TWO_RANKS, 1, "at the next step boundary"),
        (
            TWO_RANKS,
            None,
            "at the next step that is a multiple of 10 (--checkpoint.preempt-check-every: "
            "the ranks stop together)",
        ),
        (
            TWO_RANKS,
            2,
            "at the next step that is a multiple of 2 (--checkpoint.preempt-check-every: "
            "the ranks stop together)",
        ),
    ],
)
def test_the_notices_warning_says_where_the_save_happens(caplog, runtime, check_every, where):
    every = {} if check_every is None else {"check_every": check_every}
    agreement = make_agreement(runtime, signals=("SIGUSR2",), **every)
    previous = signal.getsignal(signal.SIGUSR2)
    agreement.begin()
    try:
        assert signal.getsignal(signal.SIGUSR2) is not previous  # caught, so raising it is only a notice
        with caplog.at_level(logging.WARNING, logger="fntrain.hooks.signals"):
            signal.raise_signal(signal.SIGUSR2)
    finally:
        agreement.end()
    assert [r.getMessage() for r in caplog.records] == [
        f"SIGUSR2 received: saving a checkpoint {where}, then stopping (a second signal terminates at once)"
    ]


def test_only_the_configured_signals_are_caught_and_ctrl_c_when_asked():
    watched = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
    before = {number: signal.getsignal(number) for number in watched}
    agreement = make_agreement(Runtime(), signals=("SIGUSR2",), interrupt=True)
    agreement.begin()
    try:
        caught = {number for number in watched if signal.getsignal(number) is not before[number]}
        assert caught == {signal.SIGUSR2, signal.SIGINT}
        signal.raise_signal(signal.SIGINT)  # Ctrl-C is a notice, not a KeyboardInterrupt
        assert agreement.decide(TrainState(0, 1, 1)) == Decision(preempt=True)
        assert agreement.preemption.received == "SIGINT"
    finally:
        agreement.end()
    assert {number: signal.getsignal(number) for number in watched} == before


def test_no_timed_saves_unless_asked():
    clock = Clock()
    agreement = make_agreement(Runtime(), clock=clock)
    agreement.begin()
    clock.now = 1e6
    assert agreement.decide(TrainState(0, 1, 1)) == Decision()
    agreement.end()


@pytest.mark.parametrize(
    ("runtime", "watch"),
    [(Runtime(), "signals"), (TWO_RANKS, "signals"), (TWO_RANKS, "time")],
)
def test_the_step_of_the_first_notice_is_kept(other_ranks, runtime, watch):
    """`noticed_at` is the step during which this rank first saw a notice it watches (the stop's reason
    names it): None before, the first step after, and a notice it does not watch is none."""
    other_ranks((0, 0))
    preemption = Preemption(("SIGUSR1",))
    watching = {"signals": ("SIGUSR1",)} if watch == "signals" else {"save_every_minutes": 1.0}
    agreement = make_agreement(runtime, check_every=4, preemption=preemption, clock=Clock(), **watching)
    for step in (1, 2):
        agreement.decide(TrainState(0, step, step))
    assert agreement.noticed_at() is None
    preemption.request()
    for step in (3, 4, 5):
        agreement.decide(TrainState(0, step, step))
    assert agreement.noticed_at() == (3 if watch == "signals" else None)


@pytest.mark.parametrize(
    ("rank", "notice_here", "others", "due_here", "decision"),
    [
        (0, True, [(0, 0)], False, Decision(preempt=True)),  # this rank's notice stops every rank
        (1, False, [(1, 0)], False, Decision(preempt=True)),  # so does another rank's
        (1, False, [(0, 0), (1, 0)], False, Decision(preempt=True)),
        (0, False, [(0, 0)], True, Decision(save_due=True)),  # rank 0's clock says due
        (1, False, [(0, 1)], False, Decision(save_due=True)),  # rank 0 said due: this rank saves too
        (1, False, [(0, 0)], True, Decision()),  # another rank's clock does not decide
        (1, True, [(0, 1)], False, Decision(preempt=True, save_due=True)),
        (0, False, [(0, 0), (0, 0)], False, Decision()),
    ],
)
def test_a_notice_anywhere_stops_every_rank_and_rank_0s_clock_decides_the_save(
    other_ranks, rank, notice_here, others, due_here, decision
):
    other_ranks(*others)
    clock = Clock()
    preemption = Preemption(("SIGUSR1",))
    agreement = make_agreement(Runtime(rank=rank, world_size=len(others) + 1, backend="gloo"), signals=("SIGUSR1",),
                               check_every=4, save_every_minutes=1.0, preemption=preemption, clock=clock)  # fmt: skip
    agreement.begin()
    if notice_here:
        preemption.request()
    clock.now = 60.0 if due_here else 59.0
    assert agreement.decide(TrainState(0, 8, 8)) == decision
    agreement.end()


@pytest.mark.parametrize("runtime", [Runtime(), TWO_RANKS])
def test_deciding_never_puts_the_flags_on_the_default_device(other_ranks, runtime):
    """A run whose default device is an accelerator still decides on the CPU (no device sync): with
    torch's default device set to `meta` (which cannot give values back) the decision still comes."""
    other_ranks((1, 0))
    preemption = Preemption(("SIGUSR1",))
    agreement = make_agreement(runtime, signals=("SIGUSR1",), check_every=4, preemption=preemption)
    preemption.request()
    with torch.device("meta"):
        assert agreement.decide(TrainState(0, 4, 4)) == Decision(preempt=True)



@pytest.mark.parametrize(
    "watching", [{"signals": ("SIGUSR2",)}, {"save_every_minutes": 1.0}, {"interrupt": True}]
)
def test_a_device_backend_decides_over_one_gloo_group_with_the_runs_timeout(
    one_rank_group, fake_new_groups, other_ranks, watching
):
    reduce = other_ranks((0, 0))
    agreement = make_agreement(
        Runtime(world_size=2, backend="nccl"), check_every=1, clock=Clock(), **watching
    )
    agreement.begin()
    agreement.begin()  # a second begin (a resumed loop) makes no second group
    try:
        assert fake_new_groups.made == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=77)}]
        agreement.decide(TrainState(0, 1, 1))
        assert reduce.groups == ["group 1"]
    finally:
        agreement.end()


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_a_gloo_backend_decides_over_the_default_group(fake_new_groups, other_ranks, backend):
    reduce = other_ranks((1, 0))
    agreement = make_agreement(Runtime(world_size=2, backend=backend), save_every_minutes=1.0, check_every=1,
                               clock=Clock())  # fmt: skip
    agreement.begin()
    assert agreement.decide(TrainState(0, 1, 1)) == Decision(preempt=True)
    assert fake_new_groups.made == [] and reduce.groups == [None]
    agreement.end()


def test_one_process_makes_no_group_and_warns_nothing(fake_new_groups, caplog):
    agreement = make_agreement(Runtime(), signals=("SIGUSR2",), save_every_minutes=1.0, clock=Clock())
    with caplog.at_level(logging.DEBUG):
        agreement.begin()
        agreement.end()
    assert fake_new_groups.made == [] and caplog.records == []


def test_without_gloo_one_warning_names_the_error_and_the_device_decides(monkeypatch, other_ranks, caplog):
    def no_gloo(**_kwargs):
        raise RuntimeError("gloo is not built in")

    monkeypatch.setattr(dist, "new_group", no_gloo)
    reduce = other_ranks((0, 0))
    agreement = make_agreement(Runtime(world_size=2, backend="hccl"), save_every_minutes=1.0, check_every=1,
                               clock=Clock())  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.preemption"):
        agreement.begin()
    assert [r.getMessage() for r in caplog.records] == [
        "no gloo group for checkpoint decisions (RuntimeError('gloo is not built in')); using the device group"
    ]
    assert agreement.decide(TrainState(0, 1, 1)) == Decision()
    assert reduce.groups == [None]  # the default (device) group
    agreement.end()
