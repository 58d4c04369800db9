"""The checkpoint hook's writes [S36]: one save at a time, synchronous or in the background, and what a
failed one means. The hook (`fntrain.hooks.checkpoint`) decides when; these functions save.

What the hook remembers about its saves is one record, `Saves` (the last saved and the last known
good step, the async save in flight, its gloo group and its stager). A save of a step already saved,
or of step 0, is skipped; before a new save the one in flight is settled. A save that fails (a
`CheckpointSaveError`) raises, or, with `on_save_failure` "continue", is a warning and the step counts
as unsaved again (the last good step), so the next cadence or the end tries again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fntrain.checkpoint import (
    CheckpointSaveError,
    PendingSave,
    SaveOptions,
    SaveTarget,
    make_stager,
    save,
    save_async,
)
from fntrain.state import TrainState

__all__ = ["Writer", "Saves", "save_now", "settle", "poll", "abandon", "close_stager"]

log = logging.getLogger("fntrain.hooks.checkpoint")


@dataclass(frozen=True)
class Writer:
    """How the hook saves (never changes): what and where (`target`), how (`options`), what a failure
    means (`on_failure`), and the timer every save restarts (`restart_timer`)."""

    target: SaveTarget
    options: SaveOptions
    on_failure: Literal["stop", "continue"]
    restart_timer: Callable[[], None]


@dataclass(slots=True)
class Saves:
    """What the hook remembers between events."""

    last_saved: int = -1  # global_step of the newest checkpoint this run wrote or was restored from
    last_good: int = -1  # ... of those, the newest known complete (a failed save falls back to it)
    pending: PendingSave | None = None  # the async save in flight
    group: Any = None  # dedicated gloo group for multi-rank async saves
    stager: Any = None  # reused across async saves (its pinned staging buffers are cached)
    started: bool = False  # TRAIN_BEGIN ran and neither TRAIN_END nor ABORT followed


def settle(writer: Writer, saves: Saves, *, stop: bool = False) -> None:
    """Finish the save in flight; a failed one is handled as `checkpoint.on_save_failure` says."""
    if saves.pending is not None:
        waiting, saves.pending = saves.pending, None
        t0 = time.perf_counter()
        try:
            waiting.result()
        except CheckpointSaveError as error:
            _save_failed(writer, saves, error, stop=stop)
            return
        saves.last_good = max(saves.last_good, waiting.state.global_step)
        log.debug("async checkpoint %s settled after waiting %.3f s", waiting.path, time.perf_counter() - t0)


def poll(writer: Writer, saves: Saves) -> None:
    """Settle the save in flight if it is done: a failed background save surfaces at this boundary."""
    if saves.pending is not None and saves.pending.done():
        settle(writer, saves)


def _save_failed(writer: Writer, saves: Saves, error: CheckpointSaveError, *, stop: bool) -> None:
    """A save failed (its line says which, why, and what remains): raise it (on_save_failure stop, or
    `stop`), else warn and go on, the step counting as unsaved so that the next cadence (or the end)
    tries again."""
    saves.last_saved = saves.last_good
    if stop or writer.on_failure == "stop":
        raise error
    log.warning("%s; training goes on (checkpoint.on_save_failure continue), the next save tries again",
                error.line)  # fmt: skip


def save_now(
    writer: Writer, saves: Saves, state: TrainState, *, background: bool, temporary: bool = False, stop: bool = False
) -> None:  # fmt: skip
    """Save `state` (in the background when `background`) unless it is step 0 or already saved. A
    failure is handled by `_save_failed` (`stop`: always raised)."""
    if state.global_step == saves.last_saved or state.global_step == 0:
        return
    settle(writer, saves, stop=stop)
    saves.last_saved = state.global_step  # before hook states are captured, so the checkpoint says so
    writer.restart_timer()  # any save restarts save_every_minutes
    options = dataclasses.replace(writer.options, temporary=temporary)
    kind = " (temporary)" if temporary else ""
    t0 = time.perf_counter()
    try:
        if background:
            if saves.stager is None:
                saves.stager = make_stager(writer.target.device)
            saves.pending = save_async(
                writer.target, state, options, process_group=saves.group, stager=saves.stager
            )
            log.info("checkpoint step %d%s staged in %.3f s (writing in the background)",
                     state.global_step, kind, time.perf_counter() - t0)  # fmt: skip
        else:
            save(writer.target, state, options)
            saves.last_good = state.global_step
            log.info("checkpoint step %d%s saved in %.3f s", state.global_step, kind,
                     time.perf_counter() - t0)  # fmt: skip
    except CheckpointSaveError as error:
        _save_failed(writer, saves, error, stop=stop)


def abandon(saves: Saves, timeout: float) -> None:
    """Wait at most `timeout` seconds for a save in flight (completing it if it succeeded), abandoning
    it when it takes longer; never raise (an abort path: the original error must win)."""
    try:
        if saves.pending is not None:
            waiting, saves.pending = saves.pending, None
            waiting.stop(timeout=timeout)
    except Exception as save_error:  # noqa: BLE001 - the original error must win
        log.error("settling the checkpoint in flight on abort failed: %r", save_error)


def close_stager(saves: Saves) -> None:
    """Release the stager's buffers (and join the async saves' threads); a failure is a warning."""
    if saves.stager is not None:
        closing, saves.stager = saves.stager, None
        try:
            closing.close()
        except Exception as error:  # noqa: BLE001 - releasing buffers must not hide anything
            log.warning("closing the checkpoint stager failed: %r", error)
