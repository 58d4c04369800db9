"""Peak-memory lines for one rank: the device allocator's peaks, or on a host without one the peak RSS.

`report_point` logs the peak reserved/allocated memory since the last call and resets the device peaks;
`report_epoch` logs "VRAM usage after epoch N: allocated X GiB, reserved Y GiB, peak Z GiB" (peak: the
highest peak allocated read since the last epoch line). Without an allocator both log the process's peak
RSS, which the OS cannot reset (the peak since the process started). Lines go to the logger the report
was built with (the memory hook's).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fntrain.runtime.runtime import Runtime

__all__ = ["PeakReport", "peak_report", "report_point", "report_epoch"]

_MiB = float(1 << 20)
_GiB = float(1 << 30)


@dataclass(slots=True)
class PeakReport:
    """What one rank reads its peaks from, and what it remembers between lines."""

    log: logging.Logger
    ranks: str  # "rank=.. local_rank=.. dp_rank=.." (+ tp_rank, pp_stage when those are parallel)
    device: Any
    allocator: Any  # the device allocator (torch.cuda.memory's API); None: the host's peak RSS
    peak_rss: Callable[[], int] | None  # the host's reader; None where the platform has none
    noted: bool = False  # the one-time note about peak RSS was logged (host)
    epoch_peak: int = 0  # the highest peak allocated read at a control point this epoch (device)


def peak_report(allocator: Any, runtime: Runtime, log: logging.Logger) -> PeakReport:
    """The report for this rank of `runtime`: from `allocator` when given, else from the peak RSS."""
    ranks = f"rank={runtime.rank} local_rank={runtime.local_rank} dp_rank={runtime.dp_rank}"
    ranks += f" tp_rank={runtime.tp_rank}" if runtime.tp_size > 1 else ""
    ranks += f" pp_stage={runtime.pp_rank}" if runtime.pp_size > 1 else ""
    peak_rss = _peak_rss_reader() if allocator is None else None
    return PeakReport(log, ranks, runtime.device, allocator, peak_rss)


def report_point(report: PeakReport, point: str, global_step: int) -> None:
    """Log the peaks at control point `point` (then reset the device peaks)."""
    allocator, device = report.allocator, report.device
    if allocator is None:
        rss = _read_rss(report)
        if rss is not None:
            report.log.info(
                "memory step=%s global_step=%d %s peak_rss_mib=%.1f",
                point, global_step, report.ranks, rss / _MiB,
            )  # fmt: skip
        return
    reserved = allocator.max_memory_reserved(device)
    allocated = allocator.max_memory_allocated(device)
    report.log.info(
        "memory step=%s global_step=%d %s peak_reserved_mib=%.1f peak_allocated_mib=%.1f",
        point, global_step, report.ranks, reserved / _MiB, allocated / _MiB,
    )  # fmt: skip
    allocator.reset_peak_memory_stats(device)
    if allocated > report.epoch_peak:
        report.epoch_peak = allocated


def report_epoch(report: PeakReport, epoch: int) -> None:
    """Log the memory use after epoch `epoch`."""
    allocator, device = report.allocator, report.device
    if allocator is None:
        rss = _read_rss(report)
        if rss is not None:
            report.log.info(
                "memory after epoch %d: %s peak_rss_mib=%.1f (the process's peak RSS)",
                epoch, report.ranks, rss / _MiB,
            )  # fmt: skip
        return
    # The peaks are reset at every control point: the epoch's peak is the highest one read.
    peak = max(report.epoch_peak, allocator.max_memory_allocated(device))
    report.epoch_peak = 0
    report.log.info(
        "VRAM usage after epoch %d: allocated %.2f GiB, reserved %.2f GiB, peak %.2f GiB (%s)",
        epoch, allocator.memory_allocated(device) / _GiB,
        allocator.memory_reserved(device) / _GiB, peak / _GiB, report.ranks,
    )  # fmt: skip


def _read_rss(report: PeakReport) -> int | None:
    """The host's peak RSS in bytes (None where unknown), saying once what the number means."""
    rss = None if report.peak_rss is None else report.peak_rss()
    if rss is None:
        if not report.noted:
            report.log.warning("memory.mem_info: no device allocator and no peak RSS on this platform")
            report.noted = True
    elif not report.noted:
        report.log.info(
            "memory.mem_info on %s reports the process's peak RSS, which cannot be reset", report.device
        )
        report.noted = True
    return rss


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
