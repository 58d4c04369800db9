"""Checkpoint hook [S36] [S19]: when to save; `fntrain.checkpoint` does the saving.

`checkpoint_hook(config, components, runtime, directory=...)` saves `<directory>/step_<N>/` every
`save_every` steps (at STEP_END), every `save_epochs` epochs (at EPOCH_END), and, when either is set, at
TRAIN_END if the last step is unsaved; never the same step twice, and not the step a run was restored
at. It is the last hook of the list, so a checkpoint holds the state every other hook reached at that
step. With neither cadence set the hook saves nothing (save_on_interrupt aside) and installs no handler.

- async_save: `dcp.async_save` stages the state and writes in the background. The next save first
  settles the previous one; a failed background save raises at the next step (STEP_BEGIN / STEP_END);
  TRAIN_END drains it. ABORT waits at most `abort_wait_s` for it (completing it if it succeeded) and
  never raises. Multi-rank async saves run on a dedicated gloo group so their collectives never
  interleave with training's.
- save_on_interrupt: on KeyboardInterrupt, save at ABORT only when the interrupt came between steps
  (the hook saw STEP_BEGIN without STEP_END and the state did not advance: a half-applied update, no
  save). Single-process runs only: ranks interrupted at different points could not agree on a save.
- preempt_signals (SIGTERM, SIGUSR1 by default): the signal only sets a flag; at the next step boundary
  the run saves and stops cleanly (`StopTraining`: TRAIN_END runs). With several ranks the flag is
  agreed on by an all-reduce every `preempt_check_every` steps, so all ranks save at the same step. A
  second signal gets the previous handler (e.g. terminate at once). Handlers live from TRAIN_BEGIN to
  TRAIN_END / ABORT, and only in the main thread.

The hook's own state ("checkpoint": the last saved step) is saved with the checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
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
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["CheckpointConfig", "checkpoint_hook", "checkpoint_root"]

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
    """Multi-rank runs: agree on a preemption request every K steps (one small all-reduce)."""
    restore_from: str = "none"
    """none, latest (the newest complete checkpoint under dir, else a fresh start), or a checkpoint path."""
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
        return self.save_every > 0 or self.save_epochs > 0

    def validate(self, prefix: str = "checkpoint") -> None:
        require_str(f"{prefix}.dir", self.dir, optional=True, non_empty=True)
        for name in ("save_every", "save_epochs", "keep_last"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=0)
        require_int(f"{prefix}.preempt_check_every", self.preempt_check_every, min=1)
        require_int(f"{prefix}.thread_count", self.thread_count, min=1)
        for name in ("save_at_end", "async_save", "save_on_interrupt", "weights_only", "export"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_float(f"{prefix}.abort_wait_s", self.abort_wait_s, min=0.0)
        require_str(f"{prefix}.restore_from", self.restore_from, non_empty=True)
        if not isinstance(self.preempt_signals, (tuple, list)):
            raise TypeError(
                f"{prefix}.preempt_signals must be a tuple of signal names, got {self.preempt_signals!r}"
            )
        for name in self.preempt_signals:
            if not isinstance(name, str) or not name.startswith("SIG") or not hasattr(signal, name):
                raise ValueError(f"{prefix}.preempt_signals must name signals like SIGTERM, got {name!r}")
            if name in ("SIGKILL", "SIGSTOP", "SIGINT"):
                raise ValueError(
                    f"{prefix}.preempt_signals cannot include {name} (SIGINT is save_on_interrupt)"
                )


def checkpoint_root(config: CheckpointConfig, run_dir: str | Path) -> Path:
    """Where checkpoints live: `config.dir` or `<run_dir>/checkpoints`."""
    return Path(config.dir).expanduser() if config.dir else Path(run_dir).expanduser() / "checkpoints"


def checkpoint_hook(
    config: CheckpointConfig,
    components: Components,
    runtime: Runtime,
    *,
    directory: str | Path,
    hooks: HooksArg = (),
    run_config: Mapping[str, Any] | None = None,
) -> StatefulHook:
    """The checkpoint hook (state name "checkpoint"); `hooks` (a list or a callable returning it) are the
    hooks whose `state_dict()` each checkpoint holds; `run_config` is the resolved config saved with it."""
    config.validate()
    root = Path(directory)
    last_saved = -1  # global_step of the newest checkpoint this run wrote or was restored from
    pending: PendingSave | None = None
    group: Any = None  # dedicated gloo group for multi-rank async saves
    stager: Any = None  # reused across async saves (its pinned staging buffers are cached)
    started = False
    step_begun_at: int | None = None  # global_step at STEP_BEGIN until the matching STEP_END
    preempt_flag = threading.Event()
    previous_handlers: dict[int, Any] = {}

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

    def save_now(state: TrainState, *, background: bool) -> None:
        nonlocal last_saved, pending, stager
        if state.global_step == last_saved or state.global_step == 0:
            return
        settle()
        last_saved = state.global_step  # before hook states are captured, so the checkpoint says so
        kwargs = dict(hooks=hooks, config=run_config, keep_last=config.keep_last, device=runtime.device)
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
                "checkpoint step %d staged in %.3f s (writing in the background)",
                state.global_step,
                time.perf_counter() - t0,
            )
        else:
            save(root, state, components, thread_count=config.thread_count, **kwargs)
            log.info("checkpoint step %d saved in %.3f s", state.global_step, time.perf_counter() - t0)

    def on_signal(signum: int, frame: Any) -> None:
        preempt_flag.set()
        # A second signal gets the previous behaviour (usually: terminate now).
        signal.signal(signum, previous_handlers.get(signum, signal.SIG_DFL))

    def install_signals() -> None:
        if not config.preempt_signals or threading.current_thread() is not threading.main_thread():
            return
        for name in config.preempt_signals:
            signum = getattr(signal, name)
            previous_handlers[signum] = signal.signal(signum, on_signal)

    def close_stager() -> None:
        nonlocal stager
        if stager is not None:
            stager, closing = None, stager
            try:
                closing.close()
            except Exception as error:  # noqa: BLE001 - releasing buffers must not hide anything
                log.warning("closing the checkpoint stager failed: %r", error)

    def remove_signals() -> None:
        for signum, handler in previous_handlers.items():
            try:
                signal.signal(signum, handler)
            except (ValueError, OSError):  # not the main thread, or an interpreter shutting down
                pass
        previous_handlers.clear()

    def preempt_requested(state: TrainState) -> bool:
        if not config.enabled or not config.preempt_signals:
            return False
        if runtime.world_size <= 1 or runtime.backend is None:
            return preempt_flag.is_set()
        if state.global_step % config.preempt_check_every:
            return False
        device = torch.device("cpu") if runtime.backend == "gloo" else runtime.device
        flag = torch.tensor([1 if preempt_flag.is_set() else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # a host sync every preempt_check_every steps, on every rank alike

    def begin(state: TrainState) -> None:
        nonlocal started, group, last_saved, step_begun_at
        started, step_begun_at = True, None
        if state.global_step > 0:
            last_saved = max(last_saved, state.global_step)  # a restored step is not saved again at once
        if config.async_save and runtime.world_size > 1 and runtime.backend is not None and group is None:
            group = dist.new_group(backend="gloo")
        if config.save_on_interrupt and runtime.world_size > 1:
            log.warning(
                "checkpoint.save_on_interrupt is ignored with %d ranks; use a preemption signal",
                runtime.world_size,
            )
        if config.enabled:
            install_signals()

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
            remove_signals()
            close_stager()
            step_begun_at = None

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
            poll()
            if config.save_every and state.global_step % config.save_every == 0:
                save_now(state, background=config.async_save)
            if preempt_requested(state):
                log.warning("preemption requested: saving step %d and stopping", state.global_step)
                save_now(state, background=False)
                raise StopTraining(f"preempted at step {state.global_step}")
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
                remove_signals()
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
