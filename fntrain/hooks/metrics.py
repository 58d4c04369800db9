"""Metrics logging: every `log_every` steps, the step's metrics reduced across ranks and written on rank 0.

Three pieces:

- `MetricBoard`: the channel between hooks. Producer hooks placed before the metrics hook (throughput)
  `post` host numbers on logging steps; the metrics hook merges them with the step's own metrics
  (a name given twice is a `ValueError`), clears them, and leaves the full record in `board.last` for the
  hooks after it (the progress bar's postfix).
- `MetricsLog`: the writer (rank 0 only): one `step=N epoch=E name=value ...` line to the logger
  "fntrain.metrics" (names sorted, values to 4 significant digits), and the full-precision record to each
  of its sinks (`MetricSink`): the JSON-lines file `<run_dir>/metrics.jsonl`, and optionally TensorBoard,
  Weights & Biases and MLflow. Trackers also get the run's config and tags, and a final summary. Hooks
  after the metrics hook (evaluation) write their own records through it. Sinks own files and tracker
  runs, so the log has `stop()`; they open at the first write, never at build time.
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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from fntrain.config import require_bool, require_choice, require_int, require_str
from fntrain.loop import Event, Hook, StepInfo
from fntrain.runtime.collectives import reduce_scalars
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = [
    "MetricsConfig",
    "MetricBoard",
    "MetricSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "MetricsLog",
    "metrics_writer",
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
    wandb: bool = False
    """Also log to Weights & Biases (extra: fntrain[wandb])."""
    wandb_project: str = "fntrain"
    """W&B project name."""
    wandb_entity: str | None = None
    """W&B team or user (None: your default entity)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """offline writes <run_dir>/wandb (upload it with `wandb sync`)."""
    mlflow: bool = False
    """Also log to MLflow (extra: fntrain[mlflow])."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; None: sqlite:///<run_dir>/mlflow.db."""
    mlflow_experiment: str = "fntrain"
    """MLflow experiment name (created if missing)."""
    run_name: str | None = None
    """Tracker run name (None: the run directory's name)."""
    tags: tuple[str, ...] = ()
    """Tracker tags, each `label` or `key=value`."""

    def validate(self, prefix: str = "metrics") -> None:
        require_bool(f"{prefix}.jsonl", self.jsonl)
        require_str(f"{prefix}.jsonl_name", self.jsonl_name, non_empty=True)
        require_bool(f"{prefix}.tensorboard", self.tensorboard)
        require_str(f"{prefix}.tensorboard_dir", self.tensorboard_dir, optional=True)
        require_bool(f"{prefix}.wandb", self.wandb)
        require_str(f"{prefix}.wandb_project", self.wandb_project, non_empty=True)
        require_str(f"{prefix}.wandb_entity", self.wandb_entity, optional=True)
        require_choice(f"{prefix}.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
        require_bool(f"{prefix}.mlflow", self.mlflow)
        require_str(f"{prefix}.mlflow_tracking_uri", self.mlflow_tracking_uri, optional=True)
        require_str(f"{prefix}.mlflow_experiment", self.mlflow_experiment, non_empty=True)
        require_str(f"{prefix}.run_name", self.run_name, optional=True)
        if isinstance(self.tags, (str, bytes)) or not isinstance(self.tags, (list, tuple)):
            raise TypeError(f"{prefix}.tags must be a tuple of str, got {self.tags!r}")
        for i, tag in enumerate(self.tags):
            require_str(f"{prefix}.tags[{i}]", tag, non_empty=True)


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


# ----------------------------------------------------------------------------- sinks


class MetricSink(Protocol):
    """Where records go (rank 0). A sink opens what it writes to on first use, never when built, and
    `close()` releases it (safe twice; a later call opens it again). `write` gets the full record:
    "step", "epoch", "attempt" and the metrics, values at full precision."""

    def write(self, step: int, record: Mapping[str, Any]) -> None: ...

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Each record appended as one JSON object per line to `path` (opened in append mode)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._file.write(json.dumps(dict(record)) + "\n")
        self._file.flush()

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        """Nothing: the job writes the resolved config to <run_dir>/config.json itself."""

    def summary(self, values: Mapping[str, Any]) -> None:
        """Nothing: the log holds records only (`summarize_metrics` reads the summary back from them)."""

    def close(self) -> None:
        opened, self._file = self._file, None
        if opened is not None:
            opened.close()


class TensorBoardSink:
    """Each metric as a TensorBoard scalar at its step; the config and summary as text."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
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

    def close(self) -> None:
        opened, self._writer = self._writer, None
        if opened is not None:
            opened.close()


class WandbSink:
    """A Weights & Biases run: metrics by step (epoch included), config, tags (`key=value` or a label)
    and summary. `mode="offline"` needs no network and writes under `<dir>/wandb`. Closing finishes the
    run; a record after that starts a new run, and a summary after that is dropped (reopening a finished
    offline run could overwrite its directory), so the run's summary is the one `MetricsLog.stop` sends.
    """

    def __init__(self, *, project: str, entity: str | None, name: str | None, mode: str, dir: Path) -> None:
        self.project, self.entity, self.name, self.mode, self.dir = project, entity, name, mode, dir
        self.run_id: str | None = None
        self._run: Any = None

    def _open(self) -> Any:
        if self._run is None:
            import wandb

            self.dir.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                project=self.project,
                entity=self.entity,
                name=self.name,
                dir=str(self.dir),
                mode=self.mode,
                reinit="create_new",
                settings=wandb.Settings(console="off", silent=True),
            )
            self.run_id = self._run.id
        return self._run

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        values = {name: value for name, value in record.items() if name not in ("step", "attempt")}
        self._open().log(values, step=step)

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        run = self._open()
        run.config.update(dict(config), allow_val_change=True)
        labels = [f"{key}={value}" if value else key for key, value in tags.items()]
        run.tags = tuple(dict.fromkeys([*run.tags, *labels]))

    def summary(self, values: Mapping[str, Any]) -> None:
        if self._run is None and self.run_id is not None:
            log.debug(
                "metrics: wandb run %s already finished; summary %s not logged", self.run_id, list(values)
            )
            return
        self._open().summary.update(dict(values))

    def close(self) -> None:
        opened, self._run = self._run, None
        if opened is not None:
            opened.finish()


class MlflowSink:
    """An MLflow run through `MlflowClient` (no global active run): metrics by step (epoch included), the
    flattened config as params, tags, and the summary as `summary.<name>` metrics (numbers) or tags.
    Closing ends the run: FAILED when the summary said the outcome was "aborted", else FINISHED; a later
    call logs to the same run again."""

    PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch

    def __init__(
        self, *, tracking_uri: str, experiment: str, run_name: str | None, artifact_dir: Path | None = None
    ) -> None:
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.artifact_dir = artifact_dir  # where a new experiment keeps artifacts (None: MLflow's default)
        self.run_id: str | None = None
        self._client: Any = None
        self._status = "FINISHED"

    def _open(self) -> Any:
        if self._client is None:
            for name in ("alembic", "mlflow"):  # schema migrations and store notices are not run news
                logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.tracking_uri)
            if self.run_id is None:
                found = client.get_experiment_by_name(self.experiment)
                if found is not None:
                    experiment_id = found.experiment_id
                else:
                    location = self.artifact_dir.as_uri() if self.artifact_dir is not None else None
                    experiment_id = client.create_experiment(self.experiment, artifact_location=location)
                self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            else:
                client.update_run(self.run_id, status="RUNNING")
            self._client = client
        return self._client

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [
            Metric(name, float(value), stamp, step)
            for name, value in record.items()
            if name not in ("step", "attempt")
        ]
        self._open().log_batch(self.run_id, metrics=metrics)

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        client = self._open()
        params = [Param(name, json.dumps(value) if not isinstance(value, str) else value)
                  for name, value in sorted(_flatten(config).items())]  # fmt: skip
        for start in range(0, len(params), self.PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=params[start : start + self.PARAMS_PER_BATCH])
        if tags:
            client.log_batch(self.run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])

    def summary(self, values: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        if values.get("outcome") == "aborted":
            self._status = "FAILED"
        stamp = int(time.time() * 1000)
        step = int(values.get("step", 0)) if isinstance(values.get("step", 0), (int, float)) else 0
        metrics, tags = [], []
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics.append(Metric(f"summary.{name}", float(value), stamp, step))
            else:
                tags.append(RunTag(f"summary.{name}", str(value)))
        self._open().log_batch(self.run_id, metrics=metrics, tags=tags)

    def close(self) -> None:
        opened, self._client = self._client, None
        if opened is not None:
            opened.set_terminated(self.run_id, status=self._status)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"optim": {"lr": 3e-4}}` -> `{"optim.lr": 3e-4}`."""
    flat: dict[str, Any] = {}
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, key + "."))
        else:
            flat[key] = value
    return flat


# ----------------------------------------------------------------------------- the writer


class MetricsLog:
    """Writes metric records (rank 0 only): the log line and each sink (JSON lines, TensorBoard, trackers).

    Sinks open at the first `write` (never at build time) and are closed by `stop()`; a write after
    `stop()` opens them again (the JSON-lines file in append mode), so a record is never lost to the order
    of hooks. Before a sink's first record it gets the run's config and tags (`run_config`; None: the
    resolved config the job wrote to <run_dir>/config.json, when there is one). `stop()` sends each
    sink the summary of what was written (last value of each metric, final step, best val_loss).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        jsonl_path: Path | None,
        tensorboard_dir: Path | None,
        attempt: int = 0,
        sinks: Sequence[MetricSink] = (),
        run_config: Mapping[str, Any] | None = None,
        config_path: Path | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.enabled = enabled
        self.attempt = attempt  # which launch of the run wrote a record (0, then 1 after a resume, ...)
        self.jsonl_path = jsonl_path
        self.tensorboard_dir = tensorboard_dir
        built: list[MetricSink] = []
        if jsonl_path is not None:
            built.append(JsonlSink(jsonl_path))
        if tensorboard_dir is not None:
            built.append(TensorBoardSink(tensorboard_dir))
        self.sinks: list[MetricSink] = built + list(sinks)
        self.run_config = run_config
        self.config_path = config_path
        self.tags = dict(tags or {})
        self._configured = False
        self._stopped = False  # stop() ran and no record came after it
        self._last: dict[str, Any] = {}

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
        self._remember(record)

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
        last, self._last = self._last, {}
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

    def _remember(self, record: Mapping[str, Any]) -> None:
        """Keep what the summary reports: the last value of each metric, the step, the best val_loss."""
        for name, value in record.items():
            if name not in ("epoch", "attempt"):
                self._last[name] = value
        value = record.get("val_loss")
        if (
            isinstance(value, (int, float))
            and value == value
            and value < self._last.get("best_val_loss", math.inf)
        ):
            self._last["best_val_loss"], self._last["best_val_step"] = value, record["step"]


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
    """The run's `MetricsLog` (writing on rank 0 only, each JSON record tagged with `attempt`, the
    launch of the run that wrote it); opens nothing yet. Trackers get `run_config` (None: the
    <run_dir>/config.json the job writes) and the tags of `config.tags`.

    A sink whose package is not installed (metrics.tensorboard, metrics.wandb, metrics.mlflow) is an
    `ImportError` naming the field and what to install, raised here, before any training.
    """
    config.validate()
    run_dir = Path(run_dir).expanduser()
    tensorboard_dir = None
    if config.tensorboard:
        _require_package("metrics.tensorboard", "tensorboard", "pip install tensorboard")
        tensorboard_dir = (
            Path(config.tensorboard_dir).expanduser() if config.tensorboard_dir else run_dir / "tensorboard"
        )
    name = config.run_name or run_dir.resolve().name
    sinks: list[MetricSink] = []
    if config.wandb:
        _require_package("metrics.wandb", "wandb", "pip install 'fntrain[wandb]'")
        sinks.append(
            WandbSink(
                project=config.wandb_project,
                entity=config.wandb_entity,
                name=name,
                mode=config.wandb_mode,
                dir=run_dir,
            )
        )
    if config.mlflow:
        _require_package("metrics.mlflow", "mlflow", "pip install 'fntrain[mlflow]'")
        uri = config.mlflow_tracking_uri
        sinks.append(
            MlflowSink(
                tracking_uri=uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}",
                experiment=config.mlflow_experiment,
                run_name=name,
                artifact_dir=None if uri else (run_dir / "mlflow-artifacts").resolve(),
            )
        )
        if uri is None and runtime.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its directory
    tags = dict(tag.split("=", 1) if "=" in tag else (tag, "") for tag in config.tags)
    return MetricsLog(
        enabled=runtime.rank == 0,
        jsonl_path=run_dir / config.jsonl_name if config.jsonl else None,
        tensorboard_dir=tensorboard_dir,
        attempt=attempt,
        sinks=sinks if runtime.rank == 0 else (),
        run_config=run_config,
        config_path=run_dir / "config.json",
        tags=tags,
    )


def _require_package(field_name: str, package: str, install: str) -> None:
    """An `ImportError` naming the flag when `package` cannot be imported (found without importing it)."""
    import importlib.util
    import sys

    found = sys.modules[package] is not None if package in sys.modules else importlib.util.find_spec(package)
    if not found:
        raise ImportError(
            f"{field_name}=True needs the {package} package, which is not installed; "
            f"install it ({install}) or set {field_name}=False"
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
    and keep it in `board.last`. Stops `writer` (its sinks get the summary and are closed) at TRAIN_END
    and ABORT (outcome "aborted"). The hook carries the writer as its `writer` attribute.

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
        elif event is Event.TRAIN_END:
            writer.stop()
        elif event is Event.ABORT:
            writer.stop(outcome="aborted")

    metrics.writer = writer  # type: ignore[attr-defined] - for the job's end-of-run summary
    return metrics


def metrics_writer(hooks: Sequence[Any]) -> MetricsLog | None:
    """The `MetricsLog` of the metrics hook among `hooks` (None without one): where the job sends its
    end-of-run summary."""
    for hook in hooks:
        writer = getattr(hook, "writer", None)
        if isinstance(writer, MetricsLog):
            return writer
    return None


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
            if record["val_loss"] == record["val_loss"] and record["val_loss"] < summary.get(
                "best_val_loss", math.inf
            ):
                summary["best_val_loss"], summary["best_val_step"] = record["val_loss"], record["step"]
    return summary
