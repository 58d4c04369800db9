"""Where metric records go: `MetricsConfig` and the sinks (JSON lines, TensorBoard, Weights & Biases,
MLflow), built one way by `metric_sinks`.

A sink opens what it writes to at its first use, never when built, and `close()` releases it. Adding a
sink is a change to this file alone: its config fields, its class, and one `_SinkKind` row in `_SINKS`
(the field that turns it on, the package it needs, how it is built). `check_metric_packages` reads the
same rows, so a run's first checks refuse a missing package before anything touches disk.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from fntrain.config import ConfigError, require_bool, require_choice, require_str

__all__ = [
    "RESERVED",
    "MetricsConfig",
    "MetricSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "MlflowSink",
    "metric_sinks",
    "check_metric_packages",
]

log = logging.getLogger("fntrain.metrics")

RESERVED = ("step", "epoch", "attempt")
"""The names that place a record (every sink gets them with the metrics); no metric may take them."""


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

    def add_text(self, tag: str, text: str) -> None:
        from torch.utils.tensorboard.summary import text as text_summary

        self._add(text_summary(tag, text), None)

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        self._records.close()


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
            import wandb  # optional dependency (fntrain[wandb])

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
        self, *, tracking_uri: str, experiment: str, run_name: str | None, artifact_dir: Path | None = None,
        store_dir: Path | None = None,
    ) -> None:  # fmt: skip
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.artifact_dir = artifact_dir  # where a new experiment keeps artifacts (None: MLflow's default)
        self.store_dir = store_dir  # made at first use: SQLite creates its file, not its directory
        self.run_id: str | None = None
        self._client: Any = None
        self._status = "FINISHED"

    def _open(self) -> Any:
        if self._client is None:
            for name in ("alembic", "mlflow"):  # schema migrations and store notices are not run news
                logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))
            from mlflow.tracking import MlflowClient  # optional dependency (fntrain[mlflow])

            if self.store_dir is not None:
                self.store_dir.mkdir(parents=True, exist_ok=True)

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
        from mlflow.entities import Metric  # optional dependency (fntrain[mlflow])

        stamp = int(time.time() * 1000)
        metrics = [
            Metric(name, float(value), stamp, step)
            for name, value in record.items()
            if name not in ("step", "attempt")
        ]
        self._open().log_batch(self.run_id, metrics=metrics)

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        from mlflow.entities import Param, RunTag  # optional dependency (fntrain[mlflow])

        client = self._open()
        params = [Param(name, json.dumps(value) if not isinstance(value, str) else value)
                  for name, value in sorted(_flatten(config).items())]  # fmt: skip
        for start in range(0, len(params), self.PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=params[start : start + self.PARAMS_PER_BATCH])
        if tags:
            client.log_batch(self.run_id, tags=[RunTag(key, str(value)) for key, value in tags.items()])

    def summary(self, values: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag  # optional dependency (fntrain[mlflow])

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



# ----------------------------------------------------------------------------- building them


@dataclass(frozen=True)
class _SinkKind:
    """One kind of sink: the `MetricsConfig` field that turns it on, the package it needs (None: none
    beyond torch) and how to install it, and how it is built from the config and the run directory."""

    field: str
    package: str | None
    install: str
    build: Callable[[MetricsConfig, Path, str], MetricSink]  # (config, run_dir, run name) -> sink


def _jsonl(config: MetricsConfig, run_dir: Path, name: str) -> MetricSink:
    return JsonlSink(run_dir / config.jsonl_name)


def _tensorboard(config: MetricsConfig, run_dir: Path, name: str) -> MetricSink:
    log_dir = Path(config.tensorboard_dir).expanduser() if config.tensorboard_dir else run_dir / "tensorboard"
    return TensorBoardSink(log_dir)


def _wandb(config: MetricsConfig, run_dir: Path, name: str) -> MetricSink:
    return WandbSink(project=config.wandb_project, entity=config.wandb_entity, name=name,
                     mode=config.wandb_mode, dir=run_dir)  # fmt: skip


def _mlflow(config: MetricsConfig, run_dir: Path, name: str) -> MetricSink:
    uri = config.mlflow_tracking_uri
    if uri:
        return MlflowSink(tracking_uri=uri, experiment=config.mlflow_experiment, run_name=name)
    store = run_dir.resolve()
    return MlflowSink(tracking_uri=f"sqlite:///{store / 'mlflow.db'}", experiment=config.mlflow_experiment,
                      run_name=name, artifact_dir=store / "mlflow-artifacts", store_dir=store)  # fmt: skip


_SINKS: tuple[_SinkKind, ...] = (
    _SinkKind("jsonl", None, "", _jsonl),
    _SinkKind("tensorboard", "tensorboard", "pip install tensorboard", _tensorboard),
    _SinkKind("wandb", "wandb", "pip install 'fntrain[wandb]'", _wandb),
    _SinkKind("mlflow", "mlflow", "pip install 'fntrain[mlflow]'", _mlflow),
)


def _missing_package(config: MetricsConfig, prefix: str) -> str | None:
    """What to say about the first sink turned on whose package cannot be imported (found without
    importing it), or None when every one is there."""
    for kind in _SINKS:
        if kind.package is None or not getattr(config, kind.field):
            continue
        package = kind.package
        if package in sys.modules:
            found = sys.modules[package] is not None  # None: blocked, as a test blocks an import
        else:
            found = importlib.util.find_spec(package) is not None
        if not found:
            flag = f"{prefix}.{kind.field}"
            return (
                f"{flag}=True needs the {package} package, which is not installed; "
                f"install it ({kind.install}) or set {flag}=False"
            )
    return None


def check_metric_packages(config: MetricsConfig, field_prefix: str = "metrics") -> None:
    """A `ConfigError` naming the flag when a sink `config` turns on needs a package that is not
    installed; imports nothing and creates no file (a run's first checks call it)."""
    message = _missing_package(config, field_prefix)
    if message is not None:
        raise ConfigError(message)


def metric_sinks(config: MetricsConfig, run_dir: str | Path) -> list[MetricSink]:
    """The sinks `config` turns on, in the order JSON lines, TensorBoard, W&B, MLflow, for the run in
    `run_dir` (tracker run name: `config.run_name`, else the directory's name). Validates `config`; a
    sink whose package is missing is an `ImportError` naming the flag. Opens and creates nothing."""
    config.validate()
    message = _missing_package(config, "metrics")
    if message is not None:
        raise ImportError(message)
    run_dir = Path(run_dir).expanduser()
    name = config.run_name or run_dir.resolve().name
    return [kind.build(config, run_dir, name) for kind in _SINKS if getattr(config, kind.field)]
