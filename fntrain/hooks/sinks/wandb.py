"""The Weights & Biases sink (the optional `wandb` package, imported at first use)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["WandbSink"]

log = logging.getLogger("fntrain.metrics")


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

    def text(self, step: int, name: str, text: str) -> None:
        """A text at `step` (a sample) as an HTML panel of preformatted text."""
        import html

        import wandb  # optional dependency (fntrain[wandb])

        self._open().log({name: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

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
