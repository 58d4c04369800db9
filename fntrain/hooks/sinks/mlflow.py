"""The MLflow sink (the optional `mlflow` package, imported at first use; no global active run)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MlflowSink"]


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

    def text(self, step: int, name: str, text: str) -> None:
        """A text at `step` (a sample) as the run's artifact `<name>/step_<step>.txt`."""
        safe = "".join(c if c.isalnum() or c in "-_/" else "_" for c in name).strip("/") or "text"
        self._open().log_text(self.run_id, text, f"{safe}/step_{step:08d}.txt")

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
