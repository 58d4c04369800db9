"""A run's JSON-lines metrics log after the run: read its records, rewind it for a resume, summarize it.

The file is what `JsonlSink` appends: one JSON object per line, "step", "epoch", "attempt" and the
metrics. A line cut short by a killed run is not a record (read as None, kept aside by a rewind).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fntrain.hooks.metrics_log import fold_summary

__all__ = ["read_records", "rewind_metrics", "summarize_metrics"]

_SUMMARY_KEYS = ("loss", "loss_steps", "consumed_tokens", "val_loss", "best_val_loss", "best_val_step")


def _parsed(lines: list[str]) -> list[dict[str, Any] | None]:
    """Each line as its record, or None for a line that is not a JSON object (e.g. cut short)."""
    parsed: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            record = None
        parsed.append(record if isinstance(record, dict) else None)
    return parsed


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of the log at `path`, in file order, lines that are not records left out ([] when
    there is no such file)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [record for record in _parsed(path.read_text(encoding="utf-8").splitlines()) if record is not None]


def rewind_metrics(path: str | Path, step: int) -> int:
    """Make the JSON-lines log `path` tell one story from `step` on: rows of later steps (written by an
    attempt that went past the checkpoint a run resumes from, and about to be written again) and cut-off
    lines move to `<stem>.superseded.jsonl` beside it, kept, not deleted. The log is rewritten through a
    temporary file and `os.replace`, so a crash leaves the old or the new one. Returns the rows moved."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept, later = [], []
    for line, record in zip(lines, _parsed(lines), strict=True):
        if not line.strip():
            continue
        (kept if record is not None and record.get("step", 0) <= step else later).append(line + "\n")
    if not later:
        return 0
    with open(path.with_name(f"{path.stem}.superseded{path.suffix}"), "a", encoding="utf-8") as superseded:
        superseded.writelines(later)
    tmp = path.with_name(f".{path.name}.rewind-{os.getpid()}")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(later)


def summarize_metrics(path: str | Path) -> dict[str, Any]:
    """What a run's JSON-lines log says at its end: the last logged training loss and "loss_steps", the
    (first, last) steps it is the mean of (those since the loss logged before it), the consumed tokens,
    the last and the best validation loss (with its step, see `fold_summary`); keys are absent when the
    log has no such record."""
    summary: dict[str, Any] = {}
    logged = 0  # the step of the loss logged last: the next window starts after it
    for record in read_records(path):
        fold_summary(summary, record)
        if "loss" in record:
            step = record.get("step", logged + 1)
            summary["loss_steps"], logged = (logged + 1, step), step
    return {key: summary[key] for key in _SUMMARY_KEYS if key in summary}
