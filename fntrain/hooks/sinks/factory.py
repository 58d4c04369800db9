"""The sinks a `MetricsConfig` turns on, built one way (`metric_sinks`), and the check that their packages
are installed (`check_metric_packages`), both read from one table, `_SINKS`: a row per kind of sink (the
field that turns it on, the package it needs, how it is built)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fntrain.config import ConfigError
from fntrain.hooks.sinks.base import MetricSink
from fntrain.hooks.sinks.config import MetricsConfig
from fntrain.hooks.sinks.jsonl import JsonlSink
from fntrain.hooks.sinks.mlflow import MlflowSink
from fntrain.hooks.sinks.tensorboard import TensorBoardSink
from fntrain.hooks.sinks.wandb import WandbSink

__all__ = ["metric_sinks", "check_metric_packages"]


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
