"""The metrics log: the writer every metric record of a run goes through (rank 0 only).

`MetricsLog.write` puts one `step=N epoch=E name=value ...` line on the logger "fntrain.metrics" (names
sorted, values to 4 significant digits) and sends the full-precision record to each of its sinks
(`fntrain.hooks.sinks`). Trackers also get the run's config and tags before their first record, and a
final summary (`fold_summary`: the last value of each metric, the best val_loss). Sinks own files and
tracker runs, so the log has `stop()`; they open at the first write, never at build time.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fntrain.hooks.sinks import RESERVED, MetricsConfig, MetricSink, metric_sinks
from fntrain.runtime.runtime import Runtime

__all__ = ["MetricsLog", "metrics_log", "format_record", "fold_summary", "RESERVED"]

log = logging.getLogger("fntrain.metrics")


def format_record(step: int, epoch: int, metrics: Mapping[str, float]) -> str:
    """`step=N epoch=E name=value ...`: names sorted, values to 4 significant digits (`loss=2.073`,
    `lr=3.000e-03` below 1e-2, counts such as consumed_tokens as ints). The sinks keep full precision."""
    parts = [f"step={step}", f"epoch={epoch}"]
    parts.extend(f"{name}={_short(metrics[name])}" for name in sorted(metrics))
    return " ".join(parts)


def _short(value: Any) -> str:
    """A number for a log line: ints as they are, floats to 4 significant digits."""
    if value.__class__ is int:
        return str(value)
    number = float(value)
    if number != number or number in (math.inf, -math.inf):
        return str(number)
    if number != 0 and abs(number) < 1e-2:
        return f"{number:.3e}"
    return f"{number:.4g}"


def fold_summary(summary: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Fold one record into a run's summary, in place: the last value of each metric and of "step", and
    "best_val_loss" / "best_val_step", the lowest finite-or-infinite (not NaN) val_loss and its step.
    The one place the best validation loss is decided: the trackers' summary and `summarize_metrics`."""
    for name, value in record.items():
        if name not in ("epoch", "attempt"):
            summary[name] = value
    value = record.get("val_loss")
    if isinstance(value, (int, float)) and value == value and value < summary.get("best_val_loss", math.inf):
        summary["best_val_loss"], summary["best_val_step"] = value, record.get("step")


class MetricsLog:
    """Writes metric records (rank 0 only): the log line and each sink (JSON lines, TensorBoard, trackers).

    Sinks open at the first `write` (never at build time) and are closed by `stop()`; a write after
    `stop()` opens them again (the JSON-lines file in append mode), so a record is never lost to the order
    of hooks. Before a sink's first record it gets the run's config and tags (`run_config`; None: the
    resolved config the job wrote to `config_path`, when there is one). `stop()` sends each sink the
    summary of what was written (see `fold_summary`). `latest()` is the last record written.
    """

    def __init__(
        self,
        *,
        enabled: bool,
        sinks: Sequence[MetricSink] = (),
        attempt: int = 0,
        run_config: Mapping[str, Any] | None = None,
        config_path: Path | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.enabled = enabled
        self.attempt = attempt  # which launch of the run wrote a record (0, then 1 after a resume, ...)
        self.sinks: list[MetricSink] = list(sinks)
        self.run_config = run_config
        self.config_path = config_path
        self.tags = dict(tags or {})
        self._configured = False
        self._stopped = False  # stop() ran and no record came after it
        self._summary: dict[str, Any] = {}
        self._latest: dict[str, Any] = {}
        self._last_of: dict[str, tuple[int, Any]] = {}  # name -> (step, value) of its newest record

    def write(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """Write one record for `step` (a no-op on ranks other than 0)."""
        if not self.enabled:
            return
        log.info("%s", format_record(step, epoch, metrics))
        self._configure()
        record: dict[str, Any] = {"step": step, "epoch": epoch, "attempt": self.attempt}
        # counts (consumed tokens) stay ints; everything else is a float
        record.update((name, _json_number(metrics[name])) for name in sorted(metrics))
        self._stopped = False
        for sink in self.sinks:
            sink.write(step, record)
        fold_summary(self._summary, record)
        self._latest = record
        self._last_of.update((name, (step, value)) for name, value in record.items() if name not in RESERVED)

    def text(self, step: int, name: str, text: str) -> None:
        """Send a text at `step` (a sample the model wrote) to the sinks that take text, those with a
        `text(step, name, text)` method (TensorBoard, W&B, MLflow); the others ignore it. Rank 0."""
        if not self.enabled:
            return
        self._configure()
        self._stopped = False
        for sink in self.sinks:
            if hasattr(sink, "text"):
                sink.text(step, name, text)

    def latest(self) -> Mapping[str, Any]:
        """The last record written, with its "step" and "epoch" ({} before the first, and off rank 0)."""
        return self._latest

    def last_value(self, name: str) -> tuple[int, Any] | None:
        """(step, value) of the newest record that held `name` (None: none yet, and off rank 0)."""
        return self._last_of.get(name)

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str] | None = None) -> None:
        """Send the run's config and tags to every sink now (rank 0)."""
        if not self.enabled:
            return
        self._configured = True
        merged = {**self.tags, **(tags or {})}
        for sink in self.sinks:
            sink.log_config(config, merged)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Send a run summary (e.g. the job's outcome, wall time, exported paths) to every sink (rank 0);
        after `stop()`, MLflow logs it to the same, ended run (and W&B drops it: see `WandbSink`)."""
        if not self.enabled or not values:
            return
        for sink in self.sinks:
            sink.summary(values)
        if self._stopped:
            self._close_sinks()

    def stop(self, outcome: str | None = None) -> None:
        """Send the summary of the records written (with `outcome` when given) and close every sink;
        safe to call twice and when nothing was ever written."""
        last, self._summary = self._summary, {}
        if self.enabled and last:
            if outcome is not None:
                last["outcome"] = outcome
            for sink in self.sinks:
                try:
                    sink.summary(last)
                except Exception as error:  # noqa: BLE001 - a tracker's failure must not keep the others open
                    log.warning("metrics: %s could not log the summary: %r", type(sink).__name__, error)
        self._stopped = True
        self._close_sinks()

    def _close_sinks(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:  # noqa: BLE001 - close every sink, then raise the first failure
                errors.append(error)
        if errors:
            raise errors[0]

    def _configure(self) -> None:
        """Give the sinks the config and tags before their first record (once per log)."""
        if self._configured:
            return
        self._configured = True
        config = self.run_config
        if config is None and self.config_path is not None and self.config_path.is_file():
            try:
                config = json.loads(self.config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                config = None
        tags = {**self.tags, "attempt": str(self.attempt)}
        for sink in self.sinks:
            sink.log_config(config if isinstance(config, Mapping) else {}, tags)


def _json_number(value: Any) -> int | float:
    return value if value.__class__ is int else float(value)


def metrics_log(
    config: MetricsConfig,
    runtime: Runtime,
    run_dir: str | Path,
    *,
    attempt: int = 0,
    run_config: Mapping[str, Any] | None = None,
) -> MetricsLog:
    """The run's `MetricsLog`: writing on rank 0 only (the sinks of `config` are built there, none on
    other ranks), each record tagged with `attempt`, the launch of the run that wrote it. Trackers get
    `run_config` (None: the <run_dir>/config.json the job writes) and the tags of `config.tags`.
    Opens and creates nothing; a sink whose package is missing is an `ImportError` naming the flag.
    """
    sinks = metric_sinks(config, run_dir)
    tags = dict(tag.split("=", 1) if "=" in tag else (tag, "") for tag in config.tags)
    return MetricsLog(
        enabled=runtime.rank == 0,
        sinks=sinks if runtime.rank == 0 else (),
        attempt=attempt,
        run_config=run_config,
        config_path=Path(run_dir).expanduser() / "config.json",
        tags=tags,
    )
