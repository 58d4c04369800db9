"""Memory recording hook [S35]: the device allocator's history over a window of steps, as snapshots.

`memory_hook(config, runtime)` returns a hook that, on cuda (`torch.cuda.memory`) or npu
(`torch.npu.memory`), records the caching allocator's alloc/free history between two control points and
writes `snapshot_<YYYY-mm-dd-HH-MM>_<rank>.pickle` files that PyTorch's memory visualiser
(https://pytorch.org/memory_viz) opens. Control point 0 is TRAIN_BEGIN; control point k is the k-th
STEP_BEGIN of this run (the hook is first in the recipes' hook list, so this is before the step's work
[S20]); restored global steps never shift the window. History covers control points [start_step,
end_step): recording starts at start_step and at end_step the snapshot is written and recording stops
(equal bounds: record, write and stop at once). Every rank records; only `dump_ranks` write.

While history records, an out-of-memory failure writes `snapshot_oom_<rank>.pickle` (dump ranks only):
from the allocator's OOM observer at the moment of the failure where the backend has one, else at ABORT
when the exception is an out-of-memory error. That is the one file ABORT may write; otherwise ABORT stops
history without writing, creates no directory and never raises [S9] [S18]. A stop that failed at
TRAIN_END (its error propagates, so ABORT follows) may have left history on: ABORT retries it and logs a
second failure instead of raising.

`mem_info` (independent of `enable`) logs the peak reserved/allocated device memory at every control
point and at TRAIN_END, then resets the peaks; on CPU it logs the process's peak RSS, which the OS
cannot reset (so it is the peak since the process started). After each epoch (EPOCH_END) it also logs
"VRAM usage after epoch N: allocated X GiB, reserved Y GiB, peak Z GiB" (peak: the epoch's peak
allocated memory), or on CPU the process's peak RSS.

The allocator is one seam, a module-like object with torch.cuda.memory's private API
(`_record_memory_history`, `_snapshot`, `max_memory_reserved`, ...); `memory_hook(..., allocator=fake)`
lets tests stand in for the device. Nothing touches the device before TRAIN_BEGIN.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from fntrain.config import require_bool, require_choice, require_int, require_int_list, require_str
from fntrain.loop import Event, Hook
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["MemoryConfig", "memory_hook", "is_out_of_memory"]

log = logging.getLogger("fntrain.hooks.memory")

_MiB = float(1 << 20)
_GiB = float(1 << 30)
_HISTORY_API = ("_record_memory_history",)
_SNAPSHOT_API = ("_snapshot", "_dump_snapshot")  # either; `_snapshot` preferred (see _write_snapshot)
_STATS_API = (
    "max_memory_reserved",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "memory_allocated",
    "memory_reserved",
)


@dataclass(frozen=True)
class MemoryConfig:
    """Allocator-history recording and peak-memory logging."""

    enable: bool = False
    """Record the device allocator's history over [start_step, end_step), write snapshots (cuda/npu only)."""
    start_step: int = 1
    """Control point where recording starts: 0 = TRAIN_BEGIN, k = before step k of this run."""
    end_step: int = 2
    """Control point where the snapshot is written and recording stops (>= start_step; equal = at once)."""
    save_path: str = "./memory_snapshot"
    """Folder for snapshot_<YYYY-mm-dd-HH-MM>_<rank>.pickle files (open them in pytorch.org/memory_viz)."""
    dump_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that write snapshots (the OOM snapshot too); every rank records."""
    stacks: Literal["python", "all"] = "all"
    """Stack frames kept per event: python, or all (python plus C++)."""
    max_entries: int | None = None
    """Most alloc/free events kept (a ring buffer; several KB each); None = unbounded."""
    mem_info: bool = False
    """Log peak memory at each control point (then reset the peaks) and after each epoch (CPU: peak RSS)."""

    def validate(self, prefix: str = "memory") -> None:
        """Raise `TypeError` / `ValueError` naming the dotted field; touches no device."""
        require_bool(f"{prefix}.enable", self.enable)
        require_bool(f"{prefix}.mem_info", self.mem_info)
        require_int(f"{prefix}.start_step", self.start_step)
        require_int(f"{prefix}.end_step", self.end_step)
        require_int(f"{prefix}.start_step", self.start_step, min=0)
        if self.end_step < self.start_step:
            raise ValueError(
                f"{prefix}.end_step must be >= {prefix}.start_step ({self.start_step}), got {self.end_step}"
            )
        require_str(f"{prefix}.save_path", self.save_path, non_empty=True)
        if not self.save_path.strip():
            raise ValueError(f"{prefix}.save_path must not be blank, got {self.save_path!r}")
        require_int_list(f"{prefix}.dump_ranks", self.dump_ranks, min=0)
        require_choice(f"{prefix}.stacks", self.stacks, ("python", "all"))
        if self.max_entries is not None:
            if type(self.max_entries) is not int:
                raise TypeError(f"{prefix}.max_entries must be an int or None, got {self.max_entries!r}")
            require_int(f"{prefix}.max_entries", self.max_entries, min=1)


def is_out_of_memory(error: BaseException | None) -> bool:
    """True for a device out-of-memory error: torch.OutOfMemoryError (cuda), NPU's equivalent by class
    name, or an older backend's RuntimeError whose message says "out of memory"."""
    if error is None:
        return False
    if any("OutOfMemory" in cls.__name__ for cls in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _checked_allocator(config: MemoryConfig, device: Any, allocator: Any) -> Any:
    """The allocator module for `device` (or the one given), checked to have what `config` needs."""
    device_type = getattr(device, "type", str(device))
    if allocator is None:
        allocator = _default_allocator(device_type)
    if config.enable:
        if allocator is None:
            raise RuntimeError(
                f"memory.enable needs a device allocator that records history (cuda or npu); "
                f"device {str(device)!r} has none. Turn memory.enable off (memory.mem_info works on CPU)."
            )
        _require_api(allocator, device_type, _HISTORY_API, any_of=_SNAPSHOT_API)
    if config.mem_info and allocator is not None:
        _require_api(allocator, device_type, _STATS_API)
    return allocator


def memory_hook(config: MemoryConfig, runtime: Runtime, *, allocator: Any = None) -> Hook:
    """The memory hook for `runtime`'s device; put it first in the hook list.

    Validates `config` and the backend now (before any model or device work): `enable` on a device
    without allocator history (CPU) or a backend lacking the API raises `RuntimeError`. `allocator`
    replaces the backend module (`torch.cuda.memory` / `torch.npu.memory`) resolved from the device.
    With neither `enable` nor `mem_info` the hook does nothing and never touches the device.
    """
    config.validate("memory")
    if not (config.enable or config.mem_info):
        return _disabled
    device = runtime.device
    allocator = _checked_allocator(config, device, allocator)
    window = None
    if config.enable:
        dump_ranks = sorted(set(config.dump_ranks))
        if runtime.is_main and not any(r < runtime.world_size for r in dump_ranks):
            log.warning(
                "memory.dump_ranks %s names no rank of this %d-rank run: no snapshot will be written",
                dump_ranks, runtime.world_size,
            )  # fmt: skip
        window = _HistoryWindow(
            allocator,
            config,
            rank=runtime.rank,
            writes=runtime.rank in dump_ranks,
            save_path=os.path.abspath(os.path.expanduser(config.save_path)),
            attach_oom_observer=_oom_attacher(allocator),
        )
    report = _peak_reporter(allocator, device, runtime) if config.mem_info else None

    remembered = _MemoryHookMemory()

    def memory(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_BEGIN:
            if remembered.started:
                remembered.point += 1
                if window is not None:
                    window.at(remembered.point)
                if report is not None:
                    report.at_point(str(remembered.point), state)
        elif event is Event.EPOCH_END:
            # Once per epoch stepped in this run (a restored epoch's replayed EPOCH_END logs nothing).
            if remembered.started and report is not None and remembered.point > remembered.epoch_point:
                remembered.epoch_point = remembered.point
                report.after_epoch(state)
        elif event is Event.TRAIN_BEGIN:
            # A new session: whatever a previous one left recording is discarded unwritten.
            remembered.point, remembered.epoch_point, remembered.started = 0, 0, True
            if window is not None:
                window.begin()
                window.at(0)
            if report is not None:
                report.at_point("0", state)
        elif event is Event.TRAIN_END:
            if remembered.started:
                remembered.started = False
                try:
                    if report is not None:
                        report.at_point("end", state)
                finally:
                    if window is not None:
                        window.stop()
        elif event is Event.ABORT:
            began, remembered.started = remembered.started, False
            # After TRAIN_END's stop failed the session is over but history may still be on: retry.
            if window is not None and (began or window.stop_pending):
                window.abort(info if isinstance(info, BaseException) else None)

    return memory


def _disabled(event: Event, state: TrainState, info: Any) -> None:
    """The memory hook with neither `enable` nor `mem_info`: nothing happens."""


class _HistoryWindow:
    """One rank's recording of the allocator history over [start_step, end_step).

    Owns a resource (the allocator's history and the OOM observer slot), so it is a class with an
    explicit `stop()`; `abort()` ends it without writing the window and never raises.
    """

    def __init__(
        self,
        allocator: Any,
        config: MemoryConfig,
        *,
        rank: int,
        writes: bool,
        save_path: str,
        attach_oom_observer: Callable[[Callable[..., None]], None] | None,
    ) -> None:
        self._allocator = allocator
        self._start_step = config.start_step
        self._end_step = config.end_step
        self._stacks = config.stacks
        self._max_entries = sys.maxsize if config.max_entries is None else config.max_entries
        self._rank = rank
        self._writes = writes
        self._save_path = save_path
        self._attach = attach_oom_observer
        self._slot: _OomSlot | None = None
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
            if point == self._start_step and not self._recording:
                self._start()
            if point >= self._end_step and self._recording:
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
                log.warning("memory history: retrying the stop that failed before, at ABORT")
            elif not self._recording:
                return
            if self._recording and self._writes and not self._oom_written and is_out_of_memory(error):
                try:
                    self._write_oom("ABORT")
                except BaseException as write_error:  # noqa: BLE001 - ABORT must not raise
                    log.error("could not write the out-of-memory snapshot: %r", write_error)
            self._disable(quiet=True)

    def _start(self) -> None:
        try:
            self._allocator._record_memory_history(
                enabled="all", context="all", stacks=self._stacks, max_entries=self._max_entries
            )
        except BaseException:
            # Clean up whatever the failed call left half-enabled; the session is over, its error wins.
            self._finished = True
            try:
                self._allocator._record_memory_history(enabled=None)
            except BaseException as error:  # noqa: BLE001
                self._stop_pending = True  # ABORT retries it
                log.error("stopping the memory history after a failed start raised: %r", error)
            raise
        self._recording = True
        self._attach_oom()
        log.info("memory history recording on rank %d from control point %d", self._rank, self._start_step)

    def _finish(self) -> None:
        self._finished = True
        try:
            if self._writes:
                path = self._write_snapshot(f"snapshot_{time.strftime('%Y-%m-%d-%H-%M')}_{self._rank}.pickle")
                log.info("memory snapshot written to %s (open it in https://pytorch.org/memory_viz)", path)
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
            log.error("stopping the memory history raised: %r", error)
        else:
            self._stop_pending = False

    def _write_snapshot(self, filename: str) -> str:
        """Pickle the allocator snapshot into save_path atomically (no half-written file is left).

        `_snapshot()` pickled here rather than `_dump_snapshot`, which on NPU also drives its profiler.
        """
        snapshot_fn = getattr(self._allocator, "_snapshot", None)
        path = os.path.join(self._save_path, filename)
        if snapshot_fn is None:
            os.makedirs(self._save_path, exist_ok=True)
            self._allocator._dump_snapshot(path)
            return path
        snapshot = snapshot_fn()
        os.makedirs(self._save_path, exist_ok=True)
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

    def _write_oom(self, where: str) -> None:
        path = self._write_snapshot(f"snapshot_oom_{self._rank}.pickle")
        self._oom_written = True
        log.error("out of memory on rank %d: snapshot written at %s to %s", self._rank, where, path)

    def _on_oom(self, *payload: Any) -> None:
        """The allocator's OOM observer: runs inside the failing allocation, before the stack unwinds."""
        try:
            with self._lock:
                if self._recording and self._writes:
                    # Overwritten on each OOM of the window (an allocation may fail, be retried and
                    # fail again): the file left is the one of the failure that ended the run.
                    self._write_oom(f"the allocator's OOM observer {payload!r}")
        except BaseException as error:  # noqa: BLE001 - never raise into the allocator
            log.error("could not write the out-of-memory snapshot: %r", error)

    def _attach_oom(self) -> None:
        if self._attach is None:
            return
        try:
            self._slot = _oom_slot(self._attach)
            self._slot.target = self._on_oom
        except Exception as error:  # noqa: BLE001 - recording works without it; ABORT writes instead
            log.warning(
                "could not attach the allocator's OOM observer (%r); OOM snapshots come at ABORT", error
            )

    def _detach_oom(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None and slot.target == self._on_oom:
            slot.target = None


class _OomSlot:
    """The observer attached once per allocator backend (an attachment cannot be undone); it forwards
    to the window recording now, if any."""

    def __init__(self) -> None:
        self.target: Callable[..., None] | None = None

    def __call__(self, *payload: Any) -> None:
        target = self.target
        if target is not None:
            target(*payload)


_OOM_SLOTS: dict[Any, _OomSlot] = {}
_OOM_SLOTS_LOCK = threading.Lock()


def _oom_slot(attach: Callable[[Callable[..., None]], None]) -> _OomSlot:
    with _OOM_SLOTS_LOCK:
        slot = _OOM_SLOTS.get(attach)
        if slot is None:
            slot = _OomSlot()
            attach(slot)
            _OOM_SLOTS[attach] = slot
        return slot


def _oom_attacher(allocator: Any) -> Callable[[Callable[..., None]], None] | None:
    """How to attach an OOM observer to `allocator`'s backend, or None where it has no observer API.

    A stand-in allocator may offer `attach_out_of_memory_observer`; the real backends keep theirs in
    their C extension (`torch._C._cuda_attach_out_of_memory_observer`,
    `torch_npu._C._npu_attach_out_of_memory_observer`).
    """
    attach = getattr(allocator, "attach_out_of_memory_observer", None)
    if attach is not None:
        return attach
    name = getattr(allocator, "__name__", "")
    if name.startswith("torch.cuda"):
        import torch

        return getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if name.startswith(("torch_npu", "torch.npu")):
        torch_npu = sys.modules.get("torch_npu")  # imported by _default_allocator for npu
        return getattr(getattr(torch_npu, "_C", None), "_npu_attach_out_of_memory_observer", None)
    return None


def _default_allocator(device_type: str) -> Any:
    """The backend's memory module for the device type: cuda, npu; None for devices without one."""
    if device_type == "cuda":
        return importlib.import_module("torch.cuda.memory")
    if device_type == "npu":
        from fntrain.runtime.device import import_torch_npu

        try:
            torch_npu = import_torch_npu()  # only ever for an npu device
        except RuntimeError as error:
            raise RuntimeError(
                f"memory hook: device 'npu' needs torch_npu, which failed to import: {error}"
            ) from error
        module = getattr(getattr(torch_npu, "npu", None), "memory", None)
        if module is None:
            raise RuntimeError("memory hook: this torch_npu has no torch_npu.npu.memory module")
        return module
    return None


def _require_api(
    allocator: Any, device_type: str, names: tuple[str, ...], *, any_of: tuple[str, ...] = ()
) -> None:
    missing = [name for name in names if not callable(getattr(allocator, name, None))]
    if any_of and not any(callable(getattr(allocator, name, None)) for name in any_of):
        missing.append(" or ".join(any_of))
    if missing:
        owner = getattr(allocator, "__name__", type(allocator).__name__)
        raise RuntimeError(
            f"memory hook: the {device_type} allocator ({owner}) lacks {', '.join(missing)}; "
            "this torch build cannot record or report allocator memory"
        )


@dataclass(slots=True)
class _MemoryHookMemory:
    """What the memory hook remembers between events."""

    point: int = 0  # the control point: 0 at TRAIN_BEGIN, then one per step
    epoch_point: int = 0  # the control point at the last epoch line (mem_info)
    started: bool = False  # TRAIN_BEGIN ran and neither TRAIN_END nor ABORT followed


@dataclass(slots=True)
class _ReporterMemory:
    """What the mem_info reporter remembers between control points."""

    noted: bool = False  # the one-time note about peak RSS was logged (host)
    epoch_peak: int = 0  # the highest peak allocated read at a control point this epoch (device)


class _PeakReporter(NamedTuple):
    """mem_info's two lines: at a control point (peaks, then reset) and after an epoch."""

    at_point: Callable[[str, TrainState], None]
    after_epoch: Callable[[TrainState], None]


def _peak_reporter(allocator: Any, device: Any, runtime: Runtime) -> _PeakReporter:
    """Functions that log this rank's peak memory at a control point (resetting the device peaks) and its
    memory use after an epoch."""
    ranks = f"rank={runtime.rank} local_rank={runtime.local_rank} dp_rank={runtime.dp_rank}"
    ranks += f" tp_rank={runtime.tp_rank}" if runtime.tp_size > 1 else ""
    ranks += f" pp_stage={runtime.pp_rank}" if runtime.pp_size > 1 else ""
    reporter = _ReporterMemory()

    if allocator is not None:

        def report_device(point: str, state: TrainState) -> None:
            reserved = allocator.max_memory_reserved(device)
            allocated = allocator.max_memory_allocated(device)
            log.info(
                "memory step=%s global_step=%d %s peak_reserved_mib=%.1f peak_allocated_mib=%.1f",
                point, state.global_step, ranks, reserved / _MiB, allocated / _MiB,
            )  # fmt: skip
            allocator.reset_peak_memory_stats(device)
            if allocated > reporter.epoch_peak:
                reporter.epoch_peak = allocated

        def report_device_epoch(state: TrainState) -> None:
            # The peaks are reset at every control point: the epoch's peak is the highest one read.
            peak = max(reporter.epoch_peak, allocator.max_memory_allocated(device))
            reporter.epoch_peak = 0
            log.info(
                "VRAM usage after epoch %d: allocated %.2f GiB, reserved %.2f GiB, peak %.2f GiB (%s)",
                state.epoch, allocator.memory_allocated(device) / _GiB,
                allocator.memory_reserved(device) / _GiB, peak / _GiB, ranks,
            )  # fmt: skip

        return _PeakReporter(report_device, report_device_epoch)

    peak_rss = _peak_rss_reader()

    def read_rss() -> int | None:
        rss = None if peak_rss is None else peak_rss()
        if rss is None:
            if not reporter.noted:
                log.warning("memory.mem_info: no device allocator and no peak RSS on this platform")
                reporter.noted = True
        elif not reporter.noted:
            log.info(
                "memory.mem_info on %s reports the process's peak RSS, which cannot be reset", runtime.device
            )
            reporter.noted = True
        return rss

    def report_host(point: str, state: TrainState) -> None:
        rss = read_rss()
        if rss is not None:
            log.info(
                "memory step=%s global_step=%d %s peak_rss_mib=%.1f",
                point, state.global_step, ranks, rss / _MiB,
            )  # fmt: skip

    def report_host_epoch(state: TrainState) -> None:
        rss = read_rss()
        if rss is not None:
            log.info(
                "memory after epoch %d: %s peak_rss_mib=%.1f (the process's peak RSS)",
                state.epoch, ranks, rss / _MiB,
            )  # fmt: skip

    return _PeakReporter(report_host, report_host_epoch)


def _peak_rss_reader() -> Callable[[], int] | None:
    """A function giving the process's peak resident set size in bytes; None without `resource` (Windows).

    `ru_maxrss` is the peak since the process started: the OS offers no way to reset it.
    """
    try:
        import resource
    except ImportError:
        return None
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB

    def peak_rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    return peak_rss
