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
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

from fntrain.checkpoint import SaveOptions, SaveTarget
from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.hooks.base import StatefulHook, chain, every, every_epoch, on, stateful
from fntrain.hooks.checkpoint_writes import Saves, Writer, abandon, close_stager, poll, save_now, settle
from fntrain.hooks.preemption import Agreement, group_timeout, make_agreement
from fntrain.hooks.signals import (
    DEFAULT_EXIT_CODE,
    INTERRUPT_EXIT_CODE,
    Preemption,
    preemption_reason,
    signal_numbers,
)
from fntrain.loop import Event, Hook, StopTraining
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["SaveConfig", "checkpoint_hook", "saves_at_end"]

log = logging.getLogger("fntrain.hooks.checkpoint")


@dataclass(frozen=True)
class SaveConfig:
    """When and how to save checkpoints."""

    dir: str | None = None
    """Checkpoint root (None: <run_dir>/checkpoints)."""
    save_every: int = 0
    """Save every K optimizer steps (0: off)."""
    save_epochs: int = 0
    """Save every K epochs, at the epoch's end (0: off)."""
    save_at_end: bool = True
    """When checkpointing is on (a cadence is set, or the run resumes from a checkpoint), also save after the last step if unsaved."""
    keep_last: int = 0
    """Keep the newest K complete checkpoints, delete older ones (0: keep all)."""
    async_save: bool = False
    """Write checkpoints in the background (dcp.async_save); training waits only for the staging copy."""
    save_on_interrupt: bool = False
    """On Ctrl-C, save at the next step boundary and stop (exit status 130); a second Ctrl-C exits at once."""
    preempt_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that request a save at the next step boundary and a clean exit (empty: none)."""
    preempt_check_every: int = 10
    """Multi-rank runs: agree on a preemption request and a time-based save every K steps (a tiny CPU all-reduce)."""
    preempt_exit_code: int = DEFAULT_EXIT_CODE
    """Exit status of a run stopped by a preemption signal after its checkpoint (143 = 128 + SIGTERM)."""
    save_every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (0: off); rank 0's clock decides."""
    time_based_temporary: bool = False
    """Mark time-based checkpoints temporary: each is deleted once a newer checkpoint is complete."""
    abort_wait_s: float = 60.0
    """On a failure, wait at most this long for an async save in flight before abandoning it."""
    thread_count: int = 1
    """Writer threads per rank."""
    on_save_failure: Literal["stop", "continue"] = "stop"
    """A save that fails (disk full, quota, I/O error): stop (exit status 1, resumable from the newest good checkpoint) or continue (warn, try again at the next cadence)."""
    make_room: bool = False
    """When a save will not fit, first delete the oldest verified checkpoints that keep_last (>= 2) would delete after it."""

    @property
    def enabled(self) -> bool:
        """Checkpointing is on when a cadence is set; preemption and interrupt saves need it too."""
        return self.save_every > 0 or self.save_epochs > 0 or self.save_every_minutes > 0

    def validate(self, prefix: str = "checkpoint") -> None:
        require_str(f"{prefix}.dir", self.dir, optional=True, non_empty=True)
        for name in ("save_every", "save_epochs", "keep_last"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=0)
        require_int(f"{prefix}.preempt_check_every", self.preempt_check_every, min=1)
        require_int(f"{prefix}.thread_count", self.thread_count, min=1)
        for name in ("save_at_end", "async_save", "save_on_interrupt", "time_based_temporary", "make_room"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_float(f"{prefix}.abort_wait_s", self.abort_wait_s, min=0.0)
        require_float(f"{prefix}.save_every_minutes", self.save_every_minutes, min=0.0)
        require_int(f"{prefix}.preempt_exit_code", self.preempt_exit_code, min=0, max=255)
        require_choice(f"{prefix}.on_save_failure", self.on_save_failure, ("stop", "continue"))
        signal_numbers(self.preempt_signals, f"{prefix}.preempt_signals")


def saves_at_end(config: SaveConfig, restoring: bool) -> bool:
    """Whether the run's final step is checkpointed: save_at_end, when a cadence is set or the run
    restores from a checkpoint (`restoring`: checkpoint.restore_from is not none; a run extended that
    way ends with a checkpoint of its new end)."""
    return config.save_at_end and (config.enabled or restoring)


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
    options = SaveOptions(config.keep_last, config.thread_count, make_room=config.make_room)
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
