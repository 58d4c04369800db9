"""Waiting on another thread or process without sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (asked every millisecond, and once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return bool(condition())
