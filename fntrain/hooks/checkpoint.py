"""Checkpoint hook [S36] [S19]: when to save; `fntrain.checkpoint` does the saving.

`checkpoint_hook(config, components, runtime, directory=...)` saves `<directory>/step_<N>/` every
`save_every` steps (at STEP_END), every `save_epochs` epochs (at EPOCH_END), every `save_every_minutes`
minutes, and, when any is set, at TRAIN_END if the last step is unsaved; never the same step twice, and
not the step a run was restored at. It comes after every stateful hook of the list (only the stateless
watchdog follows it), so a checkpoint holds the state every other hook reached at that step. With no
cadence set the hook saves nothing (save_on_interrupt aside) and installs no handler.

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
- The end: the final step is saved when a cadence is set or the run resumes from a checkpoint
  (`saves_at_end`), so a run extended with allow_changes train.train_iters ends with a checkpoint.
- save_on_interrupt: Ctrl-C (SIGINT) is a notice like a preemption signal: the run saves at the next
  step boundary (never a half-applied update, on every rank together) and stops with the outcome
  "interrupted" and exit status 130; a second Ctrl-C ends the process at once.
- preempt_signals and save_every_minutes: whether to stop, and whether a timed save is due, is the
  agreement's decision (`fntrain.hooks.preemption`: signal flags, rank 0's clock, one small CPU
  all-reduce every `preempt_check_every` steps), which this hook builds and asks at every STEP_END.
  On a preemption it saves the step synchronously and raises
  `StopTraining("preempted by SIGTERM at step N", outcome="preempted", exit_code=preempt_exit_code)`:
  TRAIN_END runs, `run_training` returns that outcome and exit code (143 by default), and the launcher
  exits with it after its clean teardown (`fntrain run` does). Handlers live from
  TRAIN_BEGIN to TRAIN_END / ABORT, and only in the main thread. With `time_based_temporary` a timed
  checkpoint is marked temporary and deleted once a newer checkpoint is complete.

What the hook remembers between events is one record (`_CheckpointMemory`); its state ("checkpoint":
the last saved step) is saved with the checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from fntrain.checkpoint import CheckpointSaveError, PendingSave, make_stager, save, save_async
from fntrain.components import Components
from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.hooks.base import StatefulHook, chain, every, every_epoch, on, stateful
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

__all__ = ["CheckpointConfig", "checkpoint_hook", "checkpoint_root"]

log = logging.getLogger("fntrain.hooks.checkpoint")

HooksArg = Iterable[Hook] | Callable[[], Iterable[Hook]]


@dataclass(frozen=True)
class CheckpointConfig:
    """When to save and restore checkpoints."""

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
    restore_from: str = "none"
    """none; auto (latest if one exists, else a quiet fresh start: for restarts); latest (warns if none); or a path."""
    allow_changes: tuple[str, ...] = ()
    """Fields a resume may change although they change the numbers (e.g. train.train_iters); logged."""
    weights_only: bool = False
    """Restore the model weights only: fresh optimizer, schedule, RNG, and step 0."""
    export: bool = True
    """Write the final weights to <run_dir>/model.safetensors at the end of the run."""
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

    @property
    def saves_at_end(self) -> bool:
        """Whether the run's final step is checkpointed: save_at_end, when a cadence is set or the run
        resumes from a checkpoint (a run extended by `restore_from` ends with a checkpoint of its new end)."""
        return self.save_at_end and (self.enabled or self.restore_from != "none")

    def validate(self, prefix: str = "checkpoint") -> None:
        require_str(f"{prefix}.dir", self.dir, optional=True, non_empty=True)
        for name in ("save_every", "save_epochs", "keep_last"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=0)
        require_int(f"{prefix}.preempt_check_every", self.preempt_check_every, min=1)
        require_int(f"{prefix}.thread_count", self.thread_count, min=1)
        for name in (
            "save_at_end", "async_save", "save_on_interrupt", "weights_only", "export", "time_based_temporary",
            "make_room",
        ):  # fmt: skip
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_float(f"{prefix}.abort_wait_s", self.abort_wait_s, min=0.0)
        require_float(f"{prefix}.save_every_minutes", self.save_every_minutes, min=0.0)
        require_int(f"{prefix}.preempt_exit_code", self.preempt_exit_code, min=0, max=255)
        require_str(f"{prefix}.restore_from", self.restore_from, non_empty=True)
        require_choice(f"{prefix}.on_save_failure", self.on_save_failure, ("stop", "continue"))
        if not isinstance(self.allow_changes, (tuple, list)) or not all(
            isinstance(name, str) and name for name in self.allow_changes
        ):
            raise TypeError(f"{prefix}.allow_changes must be a list of config field names, got {self.allow_changes!r}")
        signal_numbers(self.preempt_signals, f"{prefix}.preempt_signals")


def checkpoint_root(config: CheckpointConfig, run_dir: str | Path) -> Path:
    """Where checkpoints live: `config.dir` or `<run_dir>/checkpoints`."""
    return Path(config.dir).expanduser() if config.dir else Path(run_dir).expanduser() / "checkpoints"


@dataclass(frozen=True)
class _Setup:
    """What the hook was built with (never changes)."""

    config: CheckpointConfig
    components: Components
    runtime: Runtime
    root: Path
    hooks: HooksArg
    run_config: Mapping[str, Any] | None
    data: Mapping[str, Any] | None
    agreement: Agreement
    distributed: bool
    recipe: str | None = None


@dataclass(slots=True)
class _CheckpointMemory:
    """What the hook remembers between events."""

    last_saved: int = -1  # global_step of the newest checkpoint this run wrote or was restored from
    last_good: int = -1  # ... of those, the newest known complete (a failed save falls back to it)
    pending: PendingSave | None = None  # the async save in flight
    group: Any = None  # dedicated gloo group for multi-rank async saves
    stager: Any = None  # reused across async saves (its pinned staging buffers are cached)
    started: bool = False  # TRAIN_BEGIN ran and neither TRAIN_END nor ABORT followed


def checkpoint_hook(
    config: CheckpointConfig,
    components: Components,
    runtime: Runtime,
    *,
    directory: str | Path,
    hooks: HooksArg = (),
    run_config: Mapping[str, Any] | None = None,
    recipe: str | None = None,
    preemption: Preemption | None = None,
    clock: Callable[[], float] = time.monotonic,
    data: Mapping[str, Any] | None = None,
) -> StatefulHook:
    """The checkpoint hook (state name "checkpoint"); `hooks` (a list or a callable returning it) are the
    hooks whose `state_dict()` each checkpoint holds; `run_config` is the resolved config saved with it,
    `recipe` the name that loads the recipe again (for `fntrain export`), `data` the data's fingerprint
    (`fntrain.data.fingerprint`), which a resume compares.

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
    setup = _Setup(
        config, components, runtime, Path(directory), hooks, run_config, data, agreement,
        distributed=runtime.world_size > 1 and runtime.backend is not None, recipe=recipe,
    )  # fmt: skip
    memory = _CheckpointMemory()

    def hook(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.TRAIN_BEGIN:
            _begin(setup, memory, state)
        elif not memory.started:
            return  # ABORT (or anything) before TRAIN_BEGIN ran: nothing to do
        elif event is Event.STEP_BEGIN:
            _poll(setup, memory)
        elif event is Event.STEP_END:
            _step_end(setup, memory, state)
        elif event is Event.TRAIN_END:
            _train_end(setup, memory, state)
        elif event is Event.ABORT:
            memory.started = False
            _abort(setup, memory, state, info)

    def state_dict() -> dict[str, Any]:
        return {"last_saved_step": memory.last_saved}

    def load_state_dict(saved: Mapping[str, Any]) -> None:
        memory.last_saved = memory.last_good = int(saved.get("last_saved_step", -1))

    return stateful("checkpoint", chain(*_cadence_saves(setup, memory), hook), state_dict, load_state_dict)


def _cadence_saves(setup: _Setup, memory: _CheckpointMemory) -> list[Hook]:
    """The hooks that go before the main one: at STEP_END the save in flight is polled (a failed
    background save surfaces first), then the `save_every` save, and only then the main hook takes the
    preemption and timed-save decisions, so a preemption at a saved step does not save it twice; at
    EPOCH_END the `save_epochs` save. Nothing happens outside TRAIN_BEGIN .. TRAIN_END / ABORT."""
    config = setup.config

    def poll(state: TrainState, info: Any) -> None:
        if memory.started:
            _poll(setup, memory)

    def save(state: TrainState, info: Any) -> None:
        if memory.started:
            _save_now(setup, memory, state, background=config.async_save)

    parts: list[Hook] = [on(Event.STEP_END, poll)]
    if config.save_every:
        parts.append(every(config.save_every, on(Event.STEP_END, save)))
    if config.save_epochs:
        parts.append(every_epoch(config.save_epochs, on(Event.EPOCH_END, save)))
    return parts


def _settle(setup: _Setup, memory: _CheckpointMemory, *, stop: bool = False) -> None:
    """Finish the save in flight; a failed one is handled as `checkpoint.on_save_failure` says."""
    if memory.pending is not None:
        waiting, memory.pending = memory.pending, None
        t0 = time.perf_counter()
        try:
            waiting.result()
        except CheckpointSaveError as error:
            _save_failed(setup, memory, error, stop=stop)
            return
        memory.last_good = max(memory.last_good, waiting.state.global_step)
        log.debug("async checkpoint %s settled after waiting %.3f s", waiting.path, time.perf_counter() - t0)


def _poll(setup: _Setup, memory: _CheckpointMemory) -> None:
    """Settle the save in flight if it is done: a failed background save surfaces at this boundary."""
    if memory.pending is not None and memory.pending.done():
        _settle(setup, memory)


def _save_failed(setup: _Setup, memory: _CheckpointMemory, error: CheckpointSaveError, *, stop: bool) -> None:
    """A save failed (its line says which, why, and what remains): raise it (on_save_failure stop, or
    `stop`), else warn and go on, the step counting as unsaved so that the next cadence (or the end)
    tries again."""
    memory.last_saved = memory.last_good
    if stop or setup.config.on_save_failure == "stop":
        raise error
    log.warning("%s; training goes on (checkpoint.on_save_failure continue), the next save tries again",
                error.line)  # fmt: skip


def _save_now(
    setup: _Setup, memory: _CheckpointMemory, state: TrainState, *, background: bool, temporary: bool = False,
    stop: bool = False,
) -> None:  # fmt: skip
    """Save `state` (in the background when `background`) unless it is step 0 or already saved. A
    failure is handled by `_save_failed` (`stop`: always raised)."""
    if state.global_step == memory.last_saved or state.global_step == 0:
        return
    _settle(setup, memory, stop=stop)
    memory.last_saved = state.global_step  # before hook states are captured, so the checkpoint says so
    setup.agreement.restart_timer()  # any save restarts save_every_minutes
    config, runtime = setup.config, setup.runtime
    kwargs = dict(
        hooks=setup.hooks, config=setup.run_config, keep_last=config.keep_last, device=runtime.device,
        temporary=temporary, recipe=setup.recipe, data=setup.data, make_room=config.make_room,
    )  # fmt: skip
    kind = " (temporary)" if temporary else ""
    t0 = time.perf_counter()
    try:
        if background:
            if memory.stager is None:
                memory.stager = make_stager(runtime.device)
            memory.pending = save_async(
                setup.root,
                state,
                setup.components,
                process_group=memory.group,
                thread_count=config.thread_count,
                stager=memory.stager,
                **kwargs,
            )
            log.info(
                "checkpoint step %d%s staged in %.3f s (writing in the background)",
                state.global_step, kind, time.perf_counter() - t0,
            )  # fmt: skip
        else:
            save(setup.root, state, setup.components, thread_count=config.thread_count, **kwargs)
            memory.last_good = state.global_step
            log.info("checkpoint step %d%s saved in %.3f s", state.global_step, kind,
                     time.perf_counter() - t0)  # fmt: skip
    except CheckpointSaveError as error:
        _save_failed(setup, memory, error, stop=stop)


def _close_stager(memory: _CheckpointMemory) -> None:
    if memory.stager is not None:
        closing, memory.stager = memory.stager, None
        try:
            closing.close()
        except Exception as error:  # noqa: BLE001 - releasing buffers must not hide anything
            log.warning("closing the checkpoint stager failed: %r", error)


def _begin(setup: _Setup, memory: _CheckpointMemory, state: TrainState) -> None:
    config = setup.config
    memory.started = True
    if state.global_step > 0:
        memory.last_saved = max(memory.last_saved, state.global_step)  # a restored step is not saved again
        memory.last_good = max(memory.last_good, state.global_step)
    if config.async_save and setup.distributed and memory.group is None:
        memory.group = dist.new_group(backend="gloo", timeout=group_timeout())
    setup.agreement.begin()  # starts the timer, installs the handlers


def _step_end(setup: _Setup, memory: _CheckpointMemory, state: TrainState) -> None:
    config = setup.config
    decision = setup.agreement.decide(state)
    if decision.preempt:
        _stop_for_preemption(setup, memory, state)
    if decision.save_due:
        if state.global_step == memory.last_saved:  # already saved (a restored step): the timer restarts
            setup.agreement.restart_timer()
        else:
            log.info("%g minutes since the last checkpoint: saving", config.save_every_minutes)
            _save_now(
                setup, memory, state, background=config.async_save, temporary=config.time_based_temporary
            )


def _stop_for_preemption(setup: _Setup, memory: _CheckpointMemory, state: TrainState) -> None:
    """Save `state` synchronously and end the run: outcome "interrupted" (exit status 130, as a shell
    reports Ctrl-C) for a Ctrl-C, "preempted" (checkpoint.preempt_exit_code) for any other notice."""
    received = setup.agreement.preemption.received
    interrupted = received == "SIGINT"
    exit_code = INTERRUPT_EXIT_CODE if interrupted else setup.config.preempt_exit_code
    log.warning(
        "preemption (%s): saving step %d and stopping (exit status %d)",
        received,
        state.global_step,
        exit_code,
    )
    _save_now(setup, memory, state, background=False, stop=True)  # a notice's save must not fail quietly
    _settle(setup, memory, stop=True)  # an async save of this very step (save_every) must be complete
    raise StopTraining(
        preemption_reason(received, state.global_step),
        outcome="interrupted" if interrupted else "preempted",
        exit_code=exit_code,
    )


def _train_end(setup: _Setup, memory: _CheckpointMemory, state: TrainState) -> None:
    config = setup.config
    try:
        _settle(setup, memory)
        if config.saves_at_end:
            _save_now(setup, memory, state, background=False)
    finally:
        memory.started = False
        setup.agreement.end()
        _close_stager(memory)


def _abort(setup: _Setup, memory: _CheckpointMemory, state: TrainState, error: BaseException) -> None:
    """Wait (bounded) for a save in flight, abandoning it when it takes too long; never raise."""
    try:
        if memory.pending is not None:
            waiting, memory.pending = memory.pending, None
            waiting.stop(timeout=setup.config.abort_wait_s)
    except Exception as save_error:  # noqa: BLE001 - the original error must win
        log.error("settling the checkpoint in flight on abort failed: %r", save_error)
    finally:
        setup.agreement.end()
        _close_stager(memory)
