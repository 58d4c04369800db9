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

The allocator is one seam (`fntrain.runtime.allocator`), a module-like object with torch.cuda.memory's
private API; `memory_hook(..., allocator=fake)` lets tests stand in for the device. The recording lives in
`fntrain.runtime.memory_history`, the peak lines in `fntrain.runtime.memory_report`; this module decides
when. Nothing touches the device before TRAIN_BEGIN.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from fntrain.config import require_bool, require_choice, require_int, require_int_list, require_str
from fntrain.hooks.base import chain, on
from fntrain.loop import Event, Hook
from fntrain.runtime.allocator import (
    HISTORY_API,
    SNAPSHOT_API,
    STATS_API,
    default_allocator,
    oom_attacher,
    require_api,
)
from fntrain.runtime.memory_history import HistorySpec, HistoryWindow
from fntrain.runtime.memory_report import PeakReport, peak_report, report_epoch, report_point
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["MemoryConfig", "memory_hook", "check_memory_device"]

log = logging.getLogger("fntrain.hooks.memory")


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


@dataclass(slots=True)
class _Memory:
    """What the memory hook keeps between events."""

    window: HistoryWindow | None  # the allocator history over [start_step, end_step) (enable), else None
    report: PeakReport | None  # the peak lines (mem_info), else None
    point: int = 0  # the control point: 0 at TRAIN_BEGIN, then one per STEP_BEGIN
    epoch_point: int = 0  # the control point at the last epoch line (mem_info)
    started: bool = False  # TRAIN_BEGIN ran and neither TRAIN_END nor ABORT followed


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
    allocator = check_memory_device(config, runtime.device, allocator)
    memory = _Memory(
        window=_history_window(config, runtime, allocator) if config.enable else None,
        report=peak_report(allocator, runtime, log) if config.mem_info else None,
    )
    return chain(
        on(Event.TRAIN_BEGIN, lambda state, info: _train_begin(memory, state)),
        on(Event.STEP_BEGIN, lambda state, info: _control_point(memory, state)),
        on(Event.EPOCH_END, lambda state, info: _epoch_end(memory, state)),
        on(Event.TRAIN_END, lambda state, info: _train_end(memory, state)),
        on(Event.ABORT, lambda state, info: _abort(memory, info)),
    )


def _disabled(event: Event, state: TrainState, info: Any) -> None:
    """The memory hook with neither `enable` nor `mem_info`: nothing happens."""


def check_memory_device(config: MemoryConfig, device: Any, allocator: Any = None) -> Any:
    """The allocator module for `device` (or the one given), checked to have what `config` needs: a
    `RuntimeError` for `enable` on a device without allocator history, or a backend lacking the API.
    Touches no device (the run calls it in its first phase, before the model)."""
    device_type = getattr(device, "type", str(device))
    if allocator is None:
        allocator = default_allocator(device_type)
    if config.enable:
        if allocator is None:
            raise RuntimeError(
                f"memory.enable needs a device allocator that records history (cuda or npu); "
                f"device {str(device)!r} has none. Turn memory.enable off (memory.mem_info works on CPU)."
            )
        require_api(allocator, device_type, HISTORY_API, any_of=SNAPSHOT_API)
    if config.mem_info and allocator is not None:
        require_api(allocator, device_type, STATS_API)
    return allocator


def _history_window(config: MemoryConfig, runtime: Runtime, allocator: Any) -> HistoryWindow:
    """This rank's window (built, not started: nothing touches the allocator before TRAIN_BEGIN)."""
    dump_ranks = sorted(set(config.dump_ranks))
    if runtime.is_main and not any(r < runtime.world_size for r in dump_ranks):
        log.warning(
            "memory.dump_ranks %s names no rank of this %d-rank run: no snapshot will be written",
            dump_ranks, runtime.world_size,
        )  # fmt: skip
    spec = HistorySpec(
        start_step=config.start_step,
        end_step=config.end_step,
        stacks=config.stacks,
        max_entries=sys.maxsize if config.max_entries is None else config.max_entries,
        rank=runtime.rank,
        writes=runtime.rank in dump_ranks,
        save_path=os.path.abspath(os.path.expanduser(config.save_path)),
    )
    return HistoryWindow(allocator, spec, log, oom_attacher(allocator))


def _train_begin(memory: _Memory, state: TrainState) -> None:
    # A new session: whatever a previous one left recording is discarded unwritten.
    memory.point, memory.epoch_point, memory.started = 0, 0, True
    if memory.window is not None:
        memory.window.begin()
        memory.window.at(0)
    if memory.report is not None:
        report_point(memory.report, "0", state.global_step)


def _control_point(memory: _Memory, state: TrainState) -> None:
    if not memory.started:
        return
    memory.point += 1
    if memory.window is not None:
        memory.window.at(memory.point)
    if memory.report is not None:
        report_point(memory.report, str(memory.point), state.global_step)


def _epoch_end(memory: _Memory, state: TrainState) -> None:
    # Once per epoch stepped in this run (a restored epoch's replayed EPOCH_END logs nothing).
    if memory.started and memory.report is not None and memory.point > memory.epoch_point:
        memory.epoch_point = memory.point
        report_epoch(memory.report, state.epoch)


def _train_end(memory: _Memory, state: TrainState) -> None:
    if not memory.started:
        return
    memory.started = False
    try:
        if memory.report is not None:
            report_point(memory.report, "end", state.global_step)
    finally:
        if memory.window is not None:
            memory.window.stop()


def _abort(memory: _Memory, info: Any) -> None:
    began, memory.started = memory.started, False
    # After TRAIN_END's stop failed the session is over but history may still be on: retry.
    if memory.window is not None and (began or memory.window.stop_pending):
        memory.window.abort(info if isinstance(info, BaseException) else None)
