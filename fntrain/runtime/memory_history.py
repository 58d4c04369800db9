"""One rank's recording of the device allocator's history over a window of control points, as snapshots.

`HistoryWindow` records between control points `start_step` and `end_step` (the memory hook counts them)
and writes `snapshot_<YYYY-mm-dd-HH-MM>_<rank>.pickle` (PyTorch's memory visualiser opens it) when the
window closes or the run ends inside it; an out-of-memory failure while it records writes
`snapshot_oom_<rank>.pickle` from the allocator's OOM observer, or at `abort` without one. Only a window
that `writes` writes files; every window records. Logs go to the logger it is given (the hook's), so a
user's filter on that logger sees every line.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fntrain.runtime.allocator import OomSlot, is_out_of_memory, oom_slot

__all__ = ["HistorySpec", "HistoryWindow", "write_snapshot"]


@dataclass(frozen=True)
class HistorySpec:
    """What one rank's window records and where it writes."""

    start_step: int  # control point where recording starts
    end_step: int  # control point where the snapshot is written and recording stops (>= start_step)
    stacks: str  # "python" or "all"
    max_entries: int  # most alloc/free events kept (sys.maxsize: unbounded)
    rank: int
    writes: bool  # this rank writes snapshots (a dump rank)
    save_path: str  # absolute folder for the snapshots


class HistoryWindow:
    """One rank's recording of the allocator history over [start_step, end_step).

    Owns a resource (the allocator's history and the OOM observer slot), so it is a class with an
    explicit `stop()`; `abort()` ends it without writing the window and never raises.
    """

    def __init__(
        self,
        allocator: Any,
        spec: HistorySpec,
        log: logging.Logger,
        attach_oom_observer: Callable[[Callable[..., None]], None] | None,
    ) -> None:
        self._allocator = allocator
        self._spec = spec
        self._log = log
        self._attach = attach_oom_observer
        self._slot: OomSlot | None = None
        self._lock = threading.RLock()  # the OOM observer may fire on any allocating thread
        self._recording = False
        self._stop_pending = False  # a stop failed: history may still be on (ABORT retries it)
        self._finished = True
        self._oom_written = False

    @property
    def stop_pending(self) -> bool:
        """Whether stopping the history failed and history may still be on."""
        return self._stop_pending

    def begin(self) -> None:
        """Start a session: discard stale history (this hook's or anyone's) without writing it."""
        with self._lock:
            self._detach_oom()
            self._recording, self._finished, self._oom_written = False, False, False
            self._allocator._record_memory_history(enabled=None)  # disabling also clears the history
            self._stop_pending = False

    def at(self, point: int) -> None:
        """Control point `point`: start recording at start_step; write and stop at end_step."""
        if self._finished:
            return
        with self._lock:
            if point == self._spec.start_step and not self._recording:
                self._start()
            if point >= self._spec.end_step and self._recording:
                self._finish()

    def stop(self) -> None:
        """Normal end: write the (partial) window if it is recording, then stop. Idempotent."""
        with self._lock:
            if self._recording:
                self._finish()
            self._finished = True

    def abort(self, error: BaseException | None) -> None:
        """Failure: stop history without writing the window (an OOM snapshot excepted); never raises.

        A stop that failed before (at TRAIN_END) is retried here; a failure again is logged.
        """
        with self._lock:
            self._finished = True
            if self._stop_pending and not self._recording:
                self._log.warning("memory history: retrying the stop that failed before, at ABORT")
            elif not self._recording:
                return
            if self._recording and self._spec.writes and not self._oom_written and is_out_of_memory(error):
                try:
                    self._write_oom("ABORT")
                except BaseException as write_error:  # noqa: BLE001 - ABORT must not raise
                    self._log.error("could not write the out-of-memory snapshot: %r", write_error)
            self._disable(quiet=True)

    def _start(self) -> None:
        spec = self._spec
        try:
            self._allocator._record_memory_history(
                enabled="all", context="all", stacks=spec.stacks, max_entries=spec.max_entries
            )
        except BaseException:
            # Clean up whatever the failed call left half-enabled; the session is over, its error wins.
            self._finished = True
            try:
                self._allocator._record_memory_history(enabled=None)
            except BaseException as error:  # noqa: BLE001
                self._stop_pending = True  # ABORT retries it
                self._log.error("stopping the memory history after a failed start raised: %r", error)
            raise
        self._recording = True
        self._attach_oom()
        self._log.info(
            "memory history recording on rank %d from control point %d", spec.rank, spec.start_step
        )

    def _finish(self) -> None:
        self._finished = True
        try:
            if self._spec.writes:
                name = f"snapshot_{time.strftime('%Y-%m-%d-%H-%M')}_{self._spec.rank}.pickle"
                path = write_snapshot(self._allocator, self._spec.save_path, name)
                self._log.info(
                    "memory snapshot written to %s (open it in https://pytorch.org/memory_viz)", path
                )
        except BaseException:
            self._disable(quiet=True)  # a failed write still stops history; its error wins
            raise
        self._disable()

    def _disable(self, *, quiet: bool = False) -> None:
        """Stop recording (which discards the history) and release the OOM observer.

        A failed stop leaves `stop_pending` set (history may still be on) for ABORT to retry.
        """
        if not (self._recording or self._stop_pending):
            return
        self._recording = False
        self._detach_oom()
        try:
            self._allocator._record_memory_history(enabled=None)
        except BaseException as error:
            self._stop_pending = True
            if not quiet:
                raise
            self._log.error("stopping the memory history raised: %r", error)
        else:
            self._stop_pending = False

    def _write_oom(self, where: str) -> None:
        path = write_snapshot(self._allocator, self._spec.save_path, f"snapshot_oom_{self._spec.rank}.pickle")
        self._oom_written = True
        self._log.error(
            "out of memory on rank %d: snapshot written at %s to %s", self._spec.rank, where, path
        )

    def _on_oom(self, *payload: Any) -> None:
        """The allocator's OOM observer: runs inside the failing allocation, before the stack unwinds."""
        try:
            with self._lock:
                if self._recording and self._spec.writes:
                    # Overwritten on each OOM of the window (an allocation may fail, be retried and
                    # fail again): the file left is the one of the failure that ended the run.
                    self._write_oom(f"the allocator's OOM observer {payload!r}")
        except BaseException as error:  # noqa: BLE001 - never raise into the allocator
            self._log.error("could not write the out-of-memory snapshot: %r", error)

    def _attach_oom(self) -> None:
        if self._attach is None:
            return
        try:
            self._slot = oom_slot(self._attach)
            self._slot.target = self._on_oom
        except Exception as error:  # noqa: BLE001 - recording works without it; ABORT writes instead
            self._log.warning(
                "could not attach the allocator's OOM observer (%r); OOM snapshots come at ABORT", error
            )

    def _detach_oom(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None and slot.target == self._on_oom:
            slot.target = None


def write_snapshot(allocator: Any, save_path: str, filename: str) -> str:
    """Pickle the allocator snapshot to `save_path/filename` atomically (no half-written file is left).

    `_snapshot()` pickled here rather than `_dump_snapshot`, which on NPU also drives its profiler.
    """
    snapshot_fn = getattr(allocator, "_snapshot", None)
    path = os.path.join(save_path, filename)
    if snapshot_fn is None:
        os.makedirs(save_path, exist_ok=True)
        allocator._dump_snapshot(path)
        return path
    snapshot = snapshot_fn()
    os.makedirs(save_path, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "wb") as f:
            pickle.dump(snapshot, f)  # default protocol, as torch's _dump_snapshot writes it
        os.replace(partial, path)
    except BaseException:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise
    return path
