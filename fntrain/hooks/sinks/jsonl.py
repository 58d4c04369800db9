"""The JSON-lines sink: each record one JSON object per line of <run_dir>/metrics.jsonl."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonlSink"]


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
