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
- save_on_interrupt: on KeyboardInterrupt, save at ABORT only when the interrupt came between steps
  (the hook saw STEP_BEGIN without STEP_END and the state did not advance: a half-applied update, no
  save). Single-process runs only: ranks interrupted at different points could not agree on a save.
- preempt_signals (SIGTERM, SIGUSR1 by default; `fntrain.preemption`): the signal only sets a flag; at
  the next step boundary the run saves and stops cleanly (`StopTraining`: TRAIN_END runs) and the
  `Preemption` object records the step, so the recipe can exit with `preempt_exit_code` (143) after
  its clean teardown. A second signal terminates the process at once. Handlers live from TRAIN_BEGIN
  to TRAIN_END / ABORT, and only in the main thread.
- save_every_minutes: also save when that much time passed since the last save (or the start). Rank
  0's clock decides (`clock`, injectable); with `time_based_temporary` such a checkpoint is marked
  temporary and deleted once a newer checkpoint is complete.
- Agreement: one process checks both at every step. With several ranks both are decided together every
  `preempt_check_every` steps by one all-reduce (MAX) of two small integers on a CPU (gloo) group, so
  no device sync is involved: [preemption flag of this rank, time due (rank 0 only; others send 0)].
  A notice that reached any rank stops every rank, and the time decision is rank 0's alone (the
  reduction broadcasts it), so ranks whose clocks disagree still save at the same step.

The hook's own state ("checkpoint": the last saved step) is saved with the checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fntrain.checkpoint import PendingSave, make_stager, save, save_async
from fntrain.components import Components
from fntrain.config import require_bool, require_float, require_int, require_str
from fntrain.hooks.base import StatefulHook, stateful
from fntrain.loop import Event, Hook, StopTraining
from fntrain.preemption import DEFAULT_EXIT_CODE, Preemption, signal_numbers
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["CheckpointConfig", "checkpoint_hook", "checkpoint_root", "make_preemption"]

log = logging.getLogger("fntrain.hooks.checkpoint")

HooksArg = Iterable[Hook] | Callable[[], Iterable[Hook]]


@dataclass(frozen=True)
class CheckpointConfig:
    """When to save and restore checkpoints [S36]."""

    dir: str | None = None
    """Checkpoint root (None: <run_dir>/checkpoints)."""
    save_every: int = 0
    """Save every K optimizer steps (0: off)."""
    save_epochs: int = 0
    """Save every K epochs, at the epoch's end (0: off)."""
    save_at_end: bool = True
    """When checkpointing is on (save_every or save_epochs), also save after the last step if unsaved."""
    keep_last: int = 0
    """Keep the newest K complete checkpoints, delete older ones (0: keep all)."""
    async_save: bool = False
    """Write checkpoints in the background (dcp.async_save); training waits only for the staging copy."""
    save_on_interrupt: bool = False
    """On Ctrl-C between steps, save before exiting (single-process runs)."""
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
    weights_only: bool = False
    """Restore the model weights only: fresh optimizer, schedule, RNG, and step 0."""
    export: bool = True
    """Write the final weights to <run_dir>/model.safetensors at the end of the run."""
    abort_wait_s: float = 60.0
    """On a failure, wait at most this long for an async save in flight before abandoning it."""
    thread_count: int = 1
    """Writer threads per rank."""

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
        for name in (
            "save_at_end", "async_save", "save_on_interrupt", "weights_only", "export", "time_based_temporary",
        ):  # fmt: skip
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_float(f"{prefix}.abort_wait_s", self.abort_wait_s, min=0.0)
        require_float(f"{prefix}.save_every_minutes", self.save_every_minutes, min=0.0)
        require_int(f"{prefix}.preempt_exit_code", self.preempt_exit_code, min=0, max=255)
        require_str(f"{prefix}.restore_from", self.restore_from, non_empty=True)
        signal_numbers(self.preempt_signals, f"{prefix}.preempt_signals")


def checkpoint_root(config: CheckpointConfig, run_dir: str | Path) -> Path:
    """Where checkpoints live: `config.dir` or `<run_dir>/checkpoints`."""
    return Path(config.dir).expanduser() if config.dir else Path(run_dir).expanduser() / "checkpoints"


def make_preemption(config: CheckpointConfig) -> Preemption:
    """The `Preemption` for `config` (its signals and exit code); installs nothing until the hook's
    TRAIN_BEGIN. A recipe keeps it to learn whether the run was preempted (`raise_if_stopped`)."""
    return Preemption(config.preempt_signals, exit_code=config.preempt_exit_code)


def _group_timeout() -> Any:
    """The default process group's collective timeout (runtime.timeout_s), for the groups this hook
    creates (`new_group` would otherwise use torch's 30-minute default); None when unknown."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API, best effort
        return None


def checkpoint_hook(
    config: CheckpointConfig,
    components: Components,
    runtime: Runtime,
    *,
    directory: str | Path,
    hooks: HooksArg = (),
    run_config: Mapping[str, Any] | None = None,
    preemption: Preemption | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StatefulHook:
    """The checkpoint hook (state name "checkpoint"); `hooks` (a list or a callable returning it) are the
    hooks whose `state_dict()` each checkpoint holds; `run_config` is the resolved config saved with it.

    `preemption`: the signal handlers to use (`make_preemption(config)`; the caller keeps it to learn
    whether the run was preempted); None makes a private one. `clock` (seconds, monotonic) times
    `save_every_minutes`; only rank 0's matters.
    """
    config.validate()
    root = Path(directory)
    preemption = preemption if preemption is not None else make_preemption(config)
    last_saved = -1  # global_step of the newest checkpoint this run wrote or was restored from
    pending: PendingSave | None = None
    group: Any = None  # dedicated gloo group for multi-rank async saves
    control_group: Any = None  # CPU group for the preemption / time agreement (None: the default group)
    control_device = torch.device("cpu")
    stager: Any = None  # reused across async saves (its pinned staging buffers are cached)
    started = False
    step_begun_at: int | None = None  # global_step at STEP_BEGIN until the matching STEP_END
    last_save_time = 0.0  # clock() at the last save (or at TRAIN_BEGIN), for save_every_minutes
    watch_preemption = config.enabled and bool(config.preempt_signals)
    watch_time = config.save_every_minutes > 0
    interval_s = config.save_every_minutes * 60.0
    distributed = runtime.world_size > 1 and runtime.backend is not None

    def settle() -> None:
        """Finish the save in flight (raises if it failed)."""
        nonlocal pending
        if pending is not None:
            waiting, pending = pending, None
            t0 = time.perf_counter()
            waiting.result()
            log.debug(
                "async checkpoint %s settled after waiting %.3f s", waiting.path, time.perf_counter() - t0
            )

    def poll() -> None:
        if pending is not None and pending.done():
            settle()

    def save_now(state: TrainState, *, background: bool, temporary: bool = False) -> None:
        nonlocal last_saved, pending, stager, last_save_time
        if state.global_step == last_saved or state.global_step == 0:
            return
        settle()
        last_saved = state.global_step  # before hook states are captured, so the checkpoint says so
        last_save_time = clock()
        kwargs = dict(
            hooks=hooks, config=run_config, keep_last=config.keep_last, device=runtime.device,
            temporary=temporary,
        )  # fmt: skip
        kind = " (temporary)" if temporary else ""
        t0 = time.perf_counter()
        if background:
            if stager is None:
                stager = make_stager(runtime.device)
            pending = save_async(
                root,
                state,
                components,
                process_group=group,
                thread_count=config.thread_count,
                stager=stager,
                **kwargs,
            )
            log.info(
                "checkpoint step %d%s staged in %.3f s (writing in the background)",
                state.global_step,
                kind,
                time.perf_counter() - t0,
            )
        else:
            save(root, state, components, thread_count=config.thread_count, **kwargs)
            log.info(
                "checkpoint step %d%s saved in %.3f s", state.global_step, kind, time.perf_counter() - t0
            )

    def close_stager() -> None:
        nonlocal stager
        if stager is not None:
            stager, closing = None, stager
            try:
                closing.close()
            except Exception as error:  # noqa: BLE001 - releasing buffers must not hide anything
                log.warning("closing the checkpoint stager failed: %r", error)

    def make_control_group() -> None:
        """A CPU-capable group for the agreement, so that deciding never syncs the device."""
        nonlocal control_group, control_device
        backend = str(runtime.backend)
        if backend == "gloo" or "cpu:gloo" in backend:
            return  # the default group reduces CPU tensors already
        try:
            control_group = dist.new_group(backend="gloo", timeout=_group_timeout())
        except Exception as error:  # noqa: BLE001 - no gloo: fall back to the device (a sync per check)
            log.warning("no gloo group for checkpoint decisions (%r); using the device group", error)
            control_device = runtime.device

    def decide(state: TrainState) -> tuple[bool, bool]:
        """(preempt, time-based save due), the same on every rank (see the module docstring)."""
        if not (watch_preemption or watch_time):
            return False, False
        if distributed and state.global_step % config.preempt_check_every:
            return False, False
        preempt = watch_preemption and preemption.requested
        due = watch_time and runtime.rank == 0 and clock() - last_save_time >= interval_s
        if not distributed:
            return preempt, due
        flags = torch.tensor([int(preempt), int(due)], dtype=torch.int32, device=control_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control_group)
        agreed = flags.tolist()  # CPU tensor: no device sync (unless the device fallback is in use)
        return bool(agreed[0]), bool(agreed[1])

    def begin(state: TrainState) -> None:
        nonlocal started, group, last_saved, step_begun_at, last_save_time
        started, step_begun_at = True, None
        last_save_time = clock()
        if state.global_step > 0:
            last_saved = max(last_saved, state.global_step)  # a restored step is not saved again at once
        if config.async_save and distributed and group is None:
            group = dist.new_group(backend="gloo", timeout=_group_timeout())
        if distributed and (watch_preemption or watch_time) and control_group is None:
            make_control_group()
        if config.save_on_interrupt and runtime.world_size > 1:
            log.warning(
                "checkpoint.save_on_interrupt is ignored with %d ranks; use a preemption signal",
                runtime.world_size,
            )
        if watch_preemption:
            preemption.install()

    def abort(state: TrainState, error: BaseException) -> None:
        nonlocal pending, step_begun_at
        try:
            if pending is not None:
                waiting, pending = pending, None
                waiting.stop(timeout=config.abort_wait_s)
            between_steps = step_begun_at is None or state.global_step > step_begun_at
            if (
                config.save_on_interrupt
                and isinstance(error, KeyboardInterrupt)
                and runtime.world_size <= 1
                and between_steps
                and state.global_step not in (0, last_saved)
            ):
                log.warning("interrupted between steps: saving step %d before exiting", state.global_step)
                save_now(state, background=False)
            elif config.save_on_interrupt and isinstance(error, KeyboardInterrupt) and not between_steps:
                log.warning(
                    "interrupted inside step %d: not saving a half-applied update", state.global_step + 1
                )
        except Exception as save_error:  # noqa: BLE001 - the original error must win
            log.error("checkpoint on abort failed: %r", save_error)
        finally:
            preemption.uninstall()
            close_stager()
            step_begun_at = None

    def step_end(state: TrainState) -> None:
        nonlocal last_save_time
        poll()
        if config.save_every and state.global_step % config.save_every == 0:
            save_now(state, background=config.async_save)
        preempt, due = decide(state)
        if preempt:
            log.warning(
                "preemption (%s): saving step %d and stopping (exit status %d)",
                preemption.received, state.global_step, preemption.exit_code,
            )  # fmt: skip
            save_now(state, background=False)
            settle()  # an async save of this very step (save_every) must be complete before the exit
            preemption.stopped_at = state.global_step
            raise StopTraining(f"preempted at step {state.global_step}")
        if due:
            if state.global_step == last_saved:  # already saved (a restored step): the timer restarts
                last_save_time = clock()
            else:
                log.info("%g minutes since the last checkpoint: saving", config.save_every_minutes)
                save_now(state, background=config.async_save, temporary=config.time_based_temporary)

    def hook(event: Event, state: TrainState, info: Any) -> None:
        nonlocal step_begun_at, started
        if event is Event.TRAIN_BEGIN:
            begin(state)
        elif not started:
            return  # ABORT (or anything) before TRAIN_BEGIN ran: nothing to do
        elif event is Event.STEP_BEGIN:
            step_begun_at = state.global_step
            poll()
        elif event is Event.STEP_END:
            step_begun_at = None
            step_end(state)
        elif event is Event.EPOCH_END:
            if config.save_epochs and (state.epoch + 1) % config.save_epochs == 0:
                save_now(state, background=config.async_save)
        elif event is Event.TRAIN_END:
            try:
                settle()
                if config.save_at_end and config.enabled:
                    save_now(state, background=False)
            finally:
                started = False
                preemption.uninstall()
                close_stager()
        elif event is Event.ABORT:
            started = False
            abort(state, info)

    def state_dict() -> dict[str, Any]:
        return {"last_saved_step": last_saved}

    def load_state_dict(saved: Mapping[str, Any]) -> None:
        nonlocal last_saved
        last_saved = int(saved.get("last_saved_step", -1))

    return stateful("checkpoint", hook, state_dict, load_state_dict)
