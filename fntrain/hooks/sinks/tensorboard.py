"""The TensorBoard sink: scalars by step, samples, config and summary as text, all in one event file."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fntrain.hooks.sinks.base import RESERVED

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Each metric as a TensorBoard scalar at its step; the config and summary as text, all in one
    event file: a sink reopened after `close()` (the job's summary comes after the metrics hook closed
    the sinks, a final evaluation may too) appends to the file it wrote, where a new SummaryWriter would
    start a second event file holding only those few events."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        self._event_file: Path | None = None

    def _open(self) -> Any:
        if self._writer is None and self._event_file is not None:
            self._writer = _AppendedEvents(self._event_file)
        elif self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

            suffix = f".{uuid.uuid4().hex[:12]}"  # finds this writer's file among other runs' files
            self._writer = SummaryWriter(log_dir=str(self.log_dir), filename_suffix=suffix)
            self._event_file = next(self.log_dir.glob(f"events.out.tfevents.*{suffix}"), None)
        return self._writer

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        writer = self._open()
        for name in sorted(record):
            if name not in RESERVED:
                writer.add_scalar(name, float(record[name]), step)
        writer.flush()

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        if not config:
            return
        text = json.dumps({"config": dict(config), "tags": dict(tags)}, indent=2, default=str)
        self._open().add_text("config", f"```\n{text}\n```")

    def summary(self, values: Mapping[str, Any]) -> None:
        text = json.dumps(dict(values), indent=2, default=str)
        self._open().add_text("summary", f"```\n{text}\n```")

    def text(self, step: int, name: str, text: str) -> None:
        """A text at `step` (a sample), shown verbatim (a code block: markdown would join its lines)."""
        writer = self._open()
        writer.add_text(name, f"```\n{text}\n```", step)
        writer.flush()

    def close(self) -> None:
        opened, self._writer = self._writer, None
        if opened is not None:
            opened.close()


class _AppendedEvents:
    """The few SummaryWriter calls a reopened `TensorBoardSink` makes, appended synchronously to its
    event file (TFRecord files concatenate: TensorBoard reads the events on). SummaryWriter cannot
    append: it always starts a new file; the records and protos are tensorboard's and torch's own."""

    def __init__(self, path: Path) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._records = RecordWriter(open(path, "ab"))  # noqa: SIM115 - closed by close()

    def _add(self, summary: Any, step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        event = Event(wall_time=time.time(), summary=summary)
        if step is not None:
            event.step = step
        self._records.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from torch.utils.tensorboard.summary import scalar

        self._add(scalar(tag, value), step)

    def add_text(self, tag: str, text: str, step: int | None = None) -> None:
        from torch.utils.tensorboard.summary import text as text_summary

        self._add(text_summary(tag, text), step)

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()
