"""Checkpoint hook [S36] [S19]: when to save; `fntrain.checkpoint` does the saving.

`checkpoint_hook(config, target, runtime)` saves `<target.root>/step_<N>/` every `save_every` steps (at
STEP_END), every `save_epochs` epochs (at EPOCH_END), every `save_every_minutes` minutes, and, when
`saves_at_end`, at TRAIN_END if the last step is unsaved; never the same step twice, and not the step a
run was restored at. It comes after every stateful hook of the list (only the stateless watchdog
follows it), so a checkpoint holds the state every other hook reached at that step. With no cadence set
the hook saves nothing (save_on_interrupt and the end of a restoring run aside) and installs no handler.

- async_save: `dcp.async_save` stages the state and writes in the background. The next save first
  settles the previous one; a failed background save raises at the next step (STEP_BEGIN / STEP_END);
  TRAIN_END drains it. ABORT waits at most `abort_wait_s` for it (completing it if it succeeded) and
  never raises. Multi-rank async saves run on a dedicated gloo group so their collectives never
  interleave with training's.
- on_save_failure: a save that fails (`fntrain.checkpoint.CheckpointSaveError`: a full disk, a quota,
  an I/O error; sync, or async at the next step boundary) stops the run with its one line ("stop", the
  default: exit status 1, outcome "failed", resumable from the newest good checkpoint), or is a warning
  and the step counts as unsaved, so the next cadence and the end try again ("continue"). A preemption's
  save always stops on failure. make_room lets a save that will not fit delete the oldest checkpoints
  keep_last would delete after it.
- The end: the final step is saved when a cadence is set or the run restores from a checkpoint
  (`saves_at_end`), so a run extended with allow_changes train.train_iters ends with a checkpoint.
- Preemption and Ctrl-C (save_on_interrupt): whether to stop, and whether a timed save is due, is the
  agreement's decision (`fntrain.hooks.preemption`), asked at every STEP_END. On a notice the hook saves
  the step synchronously and raises `StopTraining` with outcome "preempted" (exit status
  preempt_exit_code, 143 by default) or "interrupted" (130, for Ctrl-C): TRAIN_END runs and `train`
  returns that outcome. Handlers live from TRAIN_BEGIN to TRAIN_END / ABORT, only in the main thread.
  With `time_based_temporary` a timed checkpoint is temporary: deleted once a newer one is complete.

What the hook remembers between events is one record (`fntrain.hooks.checkpoint_writes.Saves`, beside
the functions that save); its state ("checkpoint": the last saved step) is saved with the checkpoint.
Its settings (`SaveConfig`, `saves_at_end`) live in `fntrain.hooks.checkpoint_config`, re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fntrain.checkpoint import SaveOptions, SaveTarget
from fntrain.hooks.base import StatefulHook, chain, every, every_epoch, on, stateful
from fntrain.hooks.checkpoint_config import SaveConfig, saves_at_end
from fntrain.hooks.checkpoint_writes import Saves, Writer, abandon, close_stager, poll, save_now, settle
from fntrain.hooks.preemption import Agreement, group_timeout, make_agreement
from fntrain.hooks.signals import INTERRUPT_EXIT_CODE, Preemption, preemption_reason
from fntrain.loop import Event, Hook, StopTraining
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["SaveConfig", "checkpoint_hook", "saves_at_end"]

log = logging.getLogger("fntrain.hooks.checkpoint")


@dataclass(frozen=True)
class _Setup:
    """What the hook was built with (never changes)."""

    config: SaveConfig
    writer: Writer
    at_end: bool
    agreement: Agreement
    distributed: bool


def checkpoint_hook(
    config: SaveConfig,
    target: SaveTarget,
    runtime: Runtime,
    *,
    restoring: bool = False,
    preemption: Preemption | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StatefulHook:
    """The checkpoint hook (state name "checkpoint") saving `target` (its hooks' `state_dict()`, run
    config, recipe and data fingerprint; the RNG state of `runtime.device`) as `config` says.
    `restoring`: the run restores from a checkpoint (see `saves_at_end`).

    The hook builds its own preemption handlers from `config.preempt_signals`; `preemption` replaces
    them (tests call its `request()`). `clock` (seconds, monotonic) times `save_every_minutes`; only
    rank 0's matters. A preemption stop is a `StopTraining` with outcome "preempted".
    """
    config.validate()
    agreement = make_agreement(
        runtime,
        signals=config.preempt_signals if config.enabled else (),
        interrupt=config.save_on_interrupt,
        check_every=config.preempt_check_every,
        save_every_minutes=config.save_every_minutes,
        preemption=preemption,
        clock=clock,
    )
    options = SaveOptions(config.keep_last, config.thread_count, make_room=config.make_room,
                          keep_best=config.keep_best)  # fmt: skip
    target = dataclasses.replace(target, device=runtime.device)
    writer = Writer(target, options, config.on_save_failure, agreement.restart_timer)
    distributed = runtime.world_size > 1 and runtime.backend is not None
    setup = _Setup(config, writer, saves_at_end(config, restoring), agreement, distributed)
    saves = Saves()

    def lifetime(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.TRAIN_BEGIN:
            _begin(setup, saves, state)
        elif not saves.started:
            return  # ABORT (or anything) before TRAIN_BEGIN ran: nothing to do
        elif event is Event.STEP_BEGIN:
            poll(writer, saves)
        elif event is Event.STEP_END:
            _step_end(setup, saves, state)
        elif event is Event.TRAIN_END:
            _train_end(setup, saves, state)
        elif event is Event.ABORT:
            saves.started = False
            _abort(setup, saves)

    def state_dict() -> dict[str, Any]:
        return {"last_saved_step": saves.last_saved}

    def load_state_dict(saved: Mapping[str, Any]) -> None:
        saves.last_saved = saves.last_good = int(saved.get("last_saved_step", -1))

    return stateful("checkpoint", chain(*_cadence_saves(setup, saves), lifetime), state_dict, load_state_dict)


def _cadence_saves(setup: _Setup, saves: Saves) -> list[Hook]:
    """The hooks that go before the main one: at STEP_END the save in flight is polled (a failed
    background save surfaces first), then the `save_every` save, and only then the main hook takes the
    preemption and timed-save decisions, so a preemption at a saved step does not save it twice; at
    EPOCH_END the `save_epochs` save. Nothing happens outside TRAIN_BEGIN .. TRAIN_END / ABORT."""
    config, writer = setup.config, setup.writer

    def poll_pending(state: TrainState, info: Any) -> None:
        if saves.started:
            poll(writer, saves)

    def save_state(state: TrainState, info: Any) -> None:
        if saves.started:
            save_now(writer, saves, state, background=config.async_save)

    parts: list[Hook] = [on(Event.STEP_END, poll_pending)]
    if config.save_every:
        parts.append(every(config.save_every, on(Event.STEP_END, save_state)))
    if config.save_epochs:
        parts.append(every_epoch(config.save_epochs, on(Event.EPOCH_END, save_state)))
    return parts


def _begin(setup: _Setup, saves: Saves, state: TrainState) -> None:
    saves.started = True
    if state.global_step > 0:
        saves.last_saved = max(saves.last_saved, state.global_step)  # a restored step is not saved again
        saves.last_good = max(saves.last_good, state.global_step)
    if setup.config.async_save and setup.distributed and saves.group is None:
        saves.group = dist.new_group(backend="gloo", timeout=group_timeout())
    setup.agreement.begin()  # starts the timer, installs the handlers


def _step_end(setup: _Setup, saves: Saves, state: TrainState) -> None:
    config = setup.config
    decision = setup.agreement.decide(state)
    if decision.preempt:
        _stop_for_preemption(setup, saves, state)
    if decision.save_due:
        if state.global_step == saves.last_saved:  # already saved (a restored step): the timer restarts
            setup.agreement.restart_timer()
        else:
            log.info("%g minutes since the last checkpoint: saving", config.save_every_minutes)
            temporary = config.time_based_temporary
            save_now(setup.writer, saves, state, background=config.async_save, temporary=temporary)


def _stop_for_preemption(setup: _Setup, saves: Saves, state: TrainState) -> None:
    """Save `state` synchronously and end the run: outcome "interrupted" (exit status 130, as a shell
    reports Ctrl-C) for a Ctrl-C, "preempted" (checkpoint.preempt_exit_code) for any other notice."""
    received = setup.agreement.preemption.received
    interrupted = received == "SIGINT"
    exit_code = INTERRUPT_EXIT_CODE if interrupted else setup.config.preempt_exit_code
    log.warning("preemption (%s): saving step %d and stopping (exit status %d)", received, state.global_step,
                exit_code)  # fmt: skip
    save_now(setup.writer, saves, state, background=False, stop=True)  # a notice's save must not fail quietly
    settle(setup.writer, saves, stop=True)  # an async save of this very step (save_every) must be complete
    raise StopTraining(preemption_reason(received, state.global_step, setup.agreement.noticed_at()),
                       outcome="interrupted" if interrupted else "preempted", exit_code=exit_code)  # fmt: skip


def _train_end(setup: _Setup, saves: Saves, state: TrainState) -> None:
    try:
        settle(setup.writer, saves)
        if setup.at_end:
            save_now(setup.writer, saves, state, background=False)
    finally:
        saves.started = False
        setup.agreement.end()
        close_stager(saves)


def _abort(setup: _Setup, saves: Saves) -> None:
    """Wait (bounded) for a save in flight, abandoning it when it takes too long; never raise."""
    try:
        abandon(saves, setup.config.abort_wait_s)
    finally:
        setup.agreement.end()
        close_stager(saves)
