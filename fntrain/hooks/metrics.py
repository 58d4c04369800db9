"""Metrics logging [S30]: every `log_every` steps, the step's metrics reduced across ranks and written on rank 0.

Three pieces:

- `MetricBoard`: the channel between hooks. Producer hooks placed before the metrics hook (throughput)
  `post` host numbers on logging steps; the metrics hook merges them with the step's own metrics
  (a name given twice is a `ValueError`), clears them, and leaves the full record in `board.last` for the
  hooks after it (the progress bar's postfix).
- `MetricsLog`: the writer (rank 0 only): one `step=N epoch=E name=value ...` line to the logger
  "fntrain.metrics" (names sorted, values to 9 significant digits), the same record appended as a JSON line
  to `<run_dir>/metrics.jsonl`, and optionally TensorBoard scalars. Hooks after the metrics hook
  (evaluation) write their own records through it. It owns open files, so it has `stop()`; files open at
  the first write, never at build time.
- `metrics_hook`: decides the logging steps and does the reduction: on a logging step every rank stacks
  the tensor metrics and reduces them with one all_reduce (mean over ranks: the step's token-weighted loss
  is defined so that this mean is the global loss), then reads them with one host transfer. On any other
  step it costs an integer test: nothing leaves the device.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fntrain.config import require_bool, require_int, require_str
from fntrain.loop import Event, Hook, StepInfo
from fntrain.runtime.collectives import reduce_scalars
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = [
    "MetricsConfig",
    "MetricBoard",
    "MetricsLog",
    "metrics_log",
    "metrics_hook",
    "format_record",
    "is_logging_step",
    "rewind_metrics",
    "summarize_metrics",
]

log = logging.getLogger("fntrain.metrics")

RESERVED = ("step", "epoch", "attempt")


@dataclass(frozen=True)
class MetricsConfig:
    """Where logged metrics go. The cadence is the recipe's `log_every`."""

    jsonl: bool = True
    """Append each record as one JSON object per line to <run_dir>/<jsonl_name>."""
    jsonl_name: str = "metrics.jsonl"
    """File name of the JSON-lines log inside the run directory."""
    tensorboard: bool = False
    """Also write TensorBoard scalars (needs the `tensorboard` package)."""
    tensorboard_dir: str | None = None
    """TensorBoard log directory (None: <run_dir>/tensorboard)."""

    def validate(self, prefix: str = "metrics") -> None:
        require_bool(f"{prefix}.jsonl", self.jsonl)
        require_str(f"{prefix}.jsonl_name", self.jsonl_name, non_empty=True)
        require_bool(f"{prefix}.tensorboard", self.tensorboard)
        require_str(f"{prefix}.tensorboard_dir", self.tensorboard_dir, optional=True)


@dataclass
class MetricBoard:
    """Metrics passed between hooks on a logging step (one board per run, shared by its hooks).

    `pending`: host numbers posted for global step `step` by hooks that run before the metrics hook;
    `last`: the last record the metrics hook logged, with its "step" and "epoch" (for hooks after it).
    """

    pending: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    step: int = -1

    def post(self, step: int, name: str, value: float) -> None:
        """Add a metric to the record of global step `step`; a name posted twice for one step is a
        `ValueError`. Posts for an earlier step that nobody consumed (no metrics hook) are dropped."""
        if step != self.step:
            self.pending.clear()
            self.step = step
        elif name in self.pending:
            raise ValueError(f"metric {name!r} was posted twice for step {step}")
        self.pending[name] = value

    def take(self, step: int) -> dict[str, float]:
        """The metrics posted for `step`, removed from the board (stale posts are discarded)."""
        posted = self.pending.copy() if step == self.step else {}
        self.pending.clear()
        return posted


def is_logging_step(step: int, log_every: int, last_step: int | None = None) -> bool:
    """Whether `step` logs: a multiple of `log_every` (0 = never), or the run's last step when given."""
    return log_every > 0 and (step % log_every == 0 or step == last_step)


def format_record(step: int, epoch: int, metrics: Mapping[str, float]) -> str:
    """`step=N epoch=E name=value ...`: names sorted, values to 9 significant digits."""
    parts = [f"step={step}", f"epoch={epoch}"]
    parts.extend(f"{name}={float(metrics[name]):.9g}" for name in sorted(metrics))
    return " ".join(parts)


class MetricsLog:
    """Writes metric records (rank 0 only): the log line, the JSON-lines file and TensorBoard.

    Files are opened at the first `write` (never at build time) and closed by `stop()`; a write after
    `stop()` opens them again in append mode, so a record is never lost to the order of hooks.
    """

    def __init__(
        self, *, enabled: bool, jsonl_path: Path | None, tensorboard_dir: Path | None, attempt: int = 0
    ) -> None:
        self.enabled = enabled
        self.attempt = attempt  # which launch of the run wrote a record (0, then 1 after a resume, ...)
        self.jsonl_path = jsonl_path
        self.tensorboard_dir = tensorboard_dir
        self._jsonl: Any = None
        self._tensorboard: Any = None

    def write(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """Write one record for `step` (a no-op on ranks other than 0)."""
        if not self.enabled:
            return
        log.info("%s", format_record(step, epoch, metrics))
        if self.jsonl_path is not None:
            if self._jsonl is None:
                self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
                self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - closed by stop()
            record: dict[str, Any] = {"step": step, "epoch": epoch, "attempt": self.attempt}
            # counts (consumed tokens) stay ints; everything else is a float
            record.update((name, _json_number(metrics[name])) for name in sorted(metrics))
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self.tensorboard_dir is not None:
            if self._tensorboard is None:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_dir))
            for name in sorted(metrics):
                self._tensorboard.add_scalar(name, float(metrics[name]), step)
            self._tensorboard.flush()

    def stop(self) -> None:
        """Close the open files; safe to call twice and when nothing was ever written."""
        jsonl, self._jsonl = self._jsonl, None
        tensorboard, self._tensorboard = self._tensorboard, None
        try:
            if jsonl is not None:
                jsonl.close()
        finally:
            if tensorboard is not None:
                tensorboard.close()


def _json_number(value: Any) -> int | float:
    return value if value.__class__ is int else float(value)


def metrics_log(config: MetricsConfig, runtime: Runtime, run_dir: str | Path, *, attempt: int = 0) -> MetricsLog:
    """The run's `MetricsLog` (writing on rank 0 only, each JSON record tagged with `attempt`, the
    launch of the run that wrote it); opens nothing yet.

    `config.tensorboard` without the `tensorboard` package is an `ImportError` naming the field, raised
    here, before any training.
    """
    config.validate()
    run_dir = Path(run_dir).expanduser()
    tensorboard_dir = None
    if config.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "metrics.tensorboard=True needs the tensorboard package (pip install tensorboard), "
                "which is not installed; set metrics.tensorboard=False or install it"
            ) from error
        tensorboard_dir = (
            Path(config.tensorboard_dir).expanduser() if config.tensorboard_dir else run_dir / "tensorboard"
        )
    return MetricsLog(
        enabled=runtime.rank == 0,
        jsonl_path=run_dir / config.jsonl_name if config.jsonl else None,
        tensorboard_dir=tensorboard_dir,
        attempt=attempt,
    )


def metrics_hook(
    runtime: Runtime,
    *,
    log_every: int,
    writer: MetricsLog,
    board: MetricBoard | None = None,
    last_step: int | None = None,
) -> Hook:
    """The metrics hook: on each logging step (see `is_logging_step`), on every rank, reduce the step's
    metrics (mean over ranks, one collective), merge the board's posted metrics, write the record (rank 0)
    and keep it in `board.last`. Stops `writer` at TRAIN_END and ABORT.

    Tensor metrics must be scalars; Python numbers (lr) are host values the step computes identically on
    every rank and are logged as they are. A metric named twice (step and board), or named "step" or
    "epoch", is a `ValueError`.
    """
    require_int("log_every", log_every, min=0)
    if last_step is not None:
        require_int("last_step", last_step, min=1)
    every, last = log_every, last_step
    device = runtime.device
    board = board if board is not None else MetricBoard()

    def emit(state: TrainState, info: StepInfo) -> None:
        metrics = info.metrics
        tensors = {name: value for name, value in metrics.items() if isinstance(value, torch.Tensor)}
        reduced = reduce_scalars(tensors, "mean", device=device)
        record: dict[str, float] = {}
        for name, value in metrics.items():
            if name in reduced:
                record[name] = reduced[name]
            elif isinstance(value, (int, float)):
                record[name] = float(value)
            else:
                raise TypeError(
                    f"metric {name!r} must be a number or a scalar tensor, got {type(value).__name__}"
                )
        for name, value in board.take(state.global_step).items():
            if name in record:
                raise ValueError(f"metric name collision: {name!r} is both a step metric and a hook metric")
            record[name] = value
        for name in RESERVED:
            if name in record:
                raise ValueError(f"metric name collision: {name!r} is reserved for the record's position")
        writer.write(state.global_step, state.epoch, record)
        board.last.clear()
        board.last.update(record)
        board.last["step"] = state.global_step
        board.last["epoch"] = state.epoch

    def metrics(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            if is_logging_step(state.global_step, every, last):
                emit(state, info)
        elif event is Event.TRAIN_END or event is Event.ABORT:
            writer.stop()

    return metrics


# ----------------------------------------------------------------------------- the file after the run


def _records(lines: list[str]) -> list[dict[str, Any] | None]:
    parsed: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            record = None
        parsed.append(record if isinstance(record, dict) else None)
    return parsed


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
    for line, record in zip(lines, _records(lines), strict=True):
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
    """What a run's JSON-lines log says at its end: the last training loss and consumed tokens, the last
    and the best validation loss (with its step); keys are absent when the log has no such record."""
    path = Path(path)
    if not path.is_file():
        return {}
    summary: dict[str, Any] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for record in _records(lines):
        if record is None:
            continue
        if "loss" in record:
            summary["loss"] = record["loss"]
        if "consumed_tokens" in record:
            summary["consumed_tokens"] = record["consumed_tokens"]
        if "val_loss" in record:
            summary["val_loss"] = record["val_loss"]
            if record["val_loss"] == record["val_loss"] and record["val_loss"] < summary.get("best_val_loss", math.inf):
                summary["best_val_loss"], summary["best_val_step"] = record["val_loss"], record["step"]
    return summary
