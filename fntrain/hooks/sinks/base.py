"""What every metric sink is: the `MetricSink` protocol and the names that place a record (`RESERVED`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["RESERVED", "MetricSink"]

RESERVED = ("step", "epoch", "attempt")
"""The names that place a record (every sink gets them with the metrics); no metric may take them."""


class MetricSink(Protocol):
    """Where records go (rank 0). A sink opens what it writes to on first use, never when built, and
    `close()` releases it (safe twice; a later call opens it again). `write` gets the full record:
    "step", "epoch", "attempt" and the metrics, values at full precision. A sink that can show text may
    also have `text(step, name, text)` (samples the model wrote; `MetricsLog.text` calls it where it
    exists)."""

    def write(self, step: int, record: Mapping[str, Any]) -> None: ...

    def log_config(self, config: Mapping[str, Any], tags: Mapping[str, str]) -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...
