"""`MetricsConfig`: which sinks a run's metric records go to, and their settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fntrain.config import require_bool, require_choice, require_str

__all__ = ["MetricsConfig"]


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
