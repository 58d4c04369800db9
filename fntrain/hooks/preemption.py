"""The preemption / time-based-save agreement [S19] [S36]: when every rank stops, and when a timed save is due.

`make_agreement(runtime, signals=..., check_every=..., save_every_minutes=...)` returns an `Agreement`,
a record of functions the checkpoint hook calls: `begin()` at TRAIN_BEGIN (installs the signal
handlers, starts the timer), `decide(state) -> Decision(preempt, save_due)` at every STEP_END,
`restart_timer()` after every save, `end()` at TRAIN_END / ABORT (removes the handlers). The agreement
only decides; saving and stopping are the checkpoint hook's.

- preempt: a configured signal (`fntrain.hooks.signals.Preemption`) only sets a flag; `decide` reads it
  at the next step boundary. A second signal terminates the process at once (the handler gives the
  signal back to the kernel's default).
- save_due: `save_every_minutes` passed since the last save (or `begin`). Rank 0's clock decides
  (`clock`, injectable, monotonic seconds).
- Several ranks: both are decided together every `check_every` steps by one all-reduce (MAX) of two
  small integers on a CPU (gloo) group, so no device sync is involved: [preemption flag of this rank,
  time due (rank 0 only; others send 0)]. A notice that reached any rank stops every rank, and the time
  decision is rank 0's alone (the reduction broadcasts it), so ranks whose clocks disagree still save
  at the same step. One process checks both at every step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fntrain.hooks.signals import Preemption
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["Agreement", "Decision", "make_agreement", "group_timeout"]

log = logging.getLogger("fntrain.hooks.preemption")


@dataclass(frozen=True, slots=True)
class Decision:
    """What every rank agreed on at a step boundary: stop now (`preempt`), and/or save now (`save_due`)."""

    preempt: bool = False
    save_due: bool = False


# The four possible answers, built once: deciding allocates nothing on the steps between checks.
_DECISIONS = {(p, d): Decision(p, d) for p in (False, True) for d in (False, True)}
_NOTHING = _DECISIONS[False, False]


@dataclass(frozen=True)
class Agreement:
    """The agreement's functions (see the module docstring) and the signal handlers it owns."""

    begin: Callable[[], None]
    decide: Callable[[TrainState], Decision]
    restart_timer: Callable[[], None]
    end: Callable[[], None]
    preemption: Preemption
    noticed_at: Callable[[], int | None] = lambda: None  # the step during which this rank saw the notice


@dataclass(frozen=True)
class _Setup:
    """What the agreement was built with (never changes)."""

    runtime: Runtime
    preemption: Preemption
    clock: Callable[[], float]
    check_every: int
    interval_s: float
    watch_preemption: bool
    watch_time: bool
    distributed: bool


@dataclass(slots=True)
class _AgreementMemory:
    """What the agreement remembers between calls."""

    last_save_time: float = 0.0  # clock() at the last save (or at begin), for save_every_minutes
    control_group: Any = None  # CPU group for the all-reduce (None: the default group)
    control_device: Any = None  # where the flags live: cpu, or the device when no gloo group exists
    noticed_at: int | None = None  # the step at whose end this rank first saw a notice (for the stop's reason)


def group_timeout() -> Any:
    """The default process group's collective timeout (runtime.timeout_s), for the groups the hooks
    create (`new_group` would otherwise use torch's 30-minute default); None when unknown."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API, best effort
        return None


def make_agreement(
    runtime: Runtime,
    *,
    signals: Iterable[str] = (),
    check_every: int = 10,
    save_every_minutes: float = 0.0,
    preemption: Preemption | None = None,
    clock: Callable[[], float] = time.monotonic,
    interrupt: bool = False,
) -> Agreement:
    """The agreement for `runtime`: preemption is watched when `signals` is non-empty (`preemption`, if
    given, is used instead of handlers for `signals`: tests call its `request()`), time-based saves when
    `save_every_minutes` > 0; `interrupt`: Ctrl-C is a notice too. Neither: `decide` always answers
    "nothing" and `begin` installs nothing."""
    signals = tuple(signals)
    distributed = runtime.world_size > 1 and runtime.backend is not None
    when = (f"at the next step that is a multiple of {check_every} (--checkpoint.preempt-check-every: the "
            "ranks stop together)") if distributed and check_every > 1 else "at the next step boundary"  # fmt: skip
    setup = _Setup(
        runtime=runtime,
        preemption=preemption if preemption is not None else Preemption(signals, interrupt=interrupt, when=when),
        clock=clock,
        check_every=check_every,
        interval_s=save_every_minutes * 60.0,
        watch_preemption=bool(signals) or interrupt,
        watch_time=save_every_minutes > 0,
        distributed=distributed,
    )
    memory = _AgreementMemory(control_device=torch.device("cpu"))

    def restart_timer() -> None:
        memory.last_save_time = clock()

    return Agreement(
        begin=lambda: _begin(setup, memory),
        decide=lambda state: _decide(setup, memory, state),
        restart_timer=restart_timer,
        end=setup.preemption.uninstall,
        preemption=setup.preemption,
        noticed_at=lambda: memory.noticed_at,
    )


def _begin(setup: _Setup, memory: _AgreementMemory) -> None:
    memory.last_save_time = setup.clock()
    if setup.distributed and (setup.watch_preemption or setup.watch_time) and memory.control_group is None:
        _make_control_group(setup, memory)
    if setup.watch_preemption:
        setup.preemption.install()


def _make_control_group(setup: _Setup, memory: _AgreementMemory) -> None:
    """A CPU-capable group for the agreement, so that deciding never syncs the device."""
    backend = str(setup.runtime.backend)
    if backend == "gloo" or "cpu:gloo" in backend:
        return  # the default group reduces CPU tensors already
    try:
        memory.control_group = dist.new_group(backend="gloo", timeout=group_timeout())
    except Exception as error:  # noqa: BLE001 - no gloo: fall back to the device (a sync per check)
        log.warning("no gloo group for checkpoint decisions (%r); using the device group", error)
        memory.control_device = setup.runtime.device


def _decide(setup: _Setup, memory: _AgreementMemory, state: TrainState) -> Decision:
    """The same `Decision` on every rank (see the module docstring)."""
    if not (setup.watch_preemption or setup.watch_time):
        return _NOTHING
    if memory.noticed_at is None and setup.watch_preemption and setup.preemption.requested:  # a flag read, no sync
        memory.noticed_at = state.global_step
    if setup.distributed and state.global_step % setup.check_every:
        return _NOTHING
    preempt = setup.watch_preemption and setup.preemption.requested
    due = (
        setup.watch_time
        and setup.runtime.rank == 0
        and setup.clock() - memory.last_save_time >= setup.interval_s
    )
    if not setup.distributed:
        return _DECISIONS[bool(preempt), bool(due)]
    flags = torch.tensor([int(preempt), int(due)], dtype=torch.int32, device=memory.control_device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=memory.control_group)
    agreed = flags.tolist()  # CPU tensor: no device sync (unless the device fallback is in use)
    return _DECISIONS[bool(agreed[0]), bool(agreed[1])]
