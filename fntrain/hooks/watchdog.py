"""Hang watchdog hook: notice a step that takes far longer than the recent ones, dump every thread's stack
on every rank, abort with a clear message.

    hooks.append(watchdog_hook(WatchdogConfig(floor_s=600), runtime, run_dir))   # last in the list

The hook only records monotonic timestamps in the rank's `Watchdog` (no syncs, no allocations worth
naming): a heartbeat at TRAIN_BEGIN, EPOCH_BEGIN, STEP_BEGIN, STEP_END and EPOCH_END, and at STEP_END
the step period. The monitor thread, the limit it applies and what happens when it fires (stacks in
`<run_dir>/stacks/`, the HANG marker other ranks follow, exit status 124) are `fntrain.runtime.watchdog`.
Last in the hook list, the watchdog's silence covers the step itself and every other hook's work, so
`floor_s` must exceed the longest legitimate pause of a run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.loop import Event
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.watchdog import Watchdog, WatchdogConfig, hard_exit
from fntrain.state import TrainState

__all__ = ["watchdog_hook"]

log = logging.getLogger("fntrain.watchdog")


@dataclass(slots=True)
class _WatchdogMemory:
    """What the watchdog hook remembers between events."""

    watchdog: Watchdog | None = None  # the running watchdog from TRAIN_BEGIN until TRAIN_END / ABORT


def _stop(memory: _WatchdogMemory) -> None:
    """Stop and forget the running watchdog, if any."""
    if memory.watchdog is not None:
        running, memory.watchdog = memory.watchdog, None
        if not running.stop():
            log.warning("the watchdog thread did not stop within 5 s")


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The watchdog hook when disabled: starts nothing."""


def watchdog_hook(
    config: WatchdogConfig,
    runtime: Runtime,
    run_dir: str | os.PathLike,
    *,
    clock: Callable[[], float] = time.monotonic,
    abort: Callable[[int], Any] = hard_exit,
) -> Callable[[Event, TrainState, Any], None]:
    """The watchdog hook (put it last in the hook list): a `Watchdog` for this rank started at
    TRAIN_BEGIN (one left running by an earlier run on this hook is stopped first), fed heartbeats,
    stopped and joined at TRAIN_END / ABORT. `clock` and `abort` are the monitor's (tests pass fakes).
    Disabled: a no-op that starts nothing."""
    config.validate()
    if not config.enabled:
        return _inactive
    stacks_dir = Path(run_dir).expanduser() / "stacks"
    memory = _WatchdogMemory()

    def start(state: TrainState) -> None:
        _stop(memory)
        memory.watchdog = watchdog = Watchdog(
            config, rank=runtime.rank, stacks_dir=stacks_dir, clock=clock, abort=abort,
            world_size=runtime.world_size,
        )  # fmt: skip
        watchdog.beat("train begin", state.global_step)
        watchdog.start()

    def hook(event: Event, state: TrainState, info: Any) -> None:
        watchdog = memory.watchdog  # the per-step path: one attribute read and a store or two
        if event is Event.STEP_BEGIN:
            if watchdog is not None:
                watchdog.beat("step", state.global_step + 1)
        elif event is Event.STEP_END:
            if watchdog is not None:
                watchdog.step_done(state.global_step)
        elif event is Event.TRAIN_BEGIN:
            start(state)
        elif event is Event.EPOCH_BEGIN or event is Event.EPOCH_END:
            if watchdog is not None:
                watchdog.beat(event.value.replace("_", " "), state.global_step)
        elif event is Event.TRAIN_END or event is Event.ABORT:
            _stop(memory)

    return hook
