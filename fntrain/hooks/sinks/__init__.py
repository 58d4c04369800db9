"""Where metric records go: `MetricsConfig` and the sinks (JSON lines, TensorBoard, Weights & Biases,
MLflow), built one way by `metric_sinks`.

A sink opens what it writes to at its first use, never when built, and `close()` releases it. Adding a
sink is a module of its own here (its class), its config fields in `config.py`, and one `_SinkKind` row
in `factory._SINKS` (the field that turns it on, the package it needs, how it is built).
`check_metric_packages` reads the same rows, so a run's first checks refuse a missing package before
anything touches disk.
"""

from fntrain.hooks.sinks.base import RESERVED, MetricSink
from fntrain.hooks.sinks.config import MetricsConfig
from fntrain.hooks.sinks.factory import check_metric_packages, metric_sinks
from fntrain.hooks.sinks.jsonl import JsonlSink
from fntrain.hooks.sinks.mlflow import MlflowSink
from fntrain.hooks.sinks.tensorboard import TensorBoardSink
from fntrain.hooks.sinks.wandb import WandbSink

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
