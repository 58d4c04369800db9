"""`repeat_reads(data, steps)`: a `data(epoch, cursor)` whose every batch serves `steps` optimizer steps.

A generating objective (GRPO) reads one generation batch of prompts and trains on it for several
optimizer steps (`RunPlan.steps_per_read`). The loop still takes one batch per step, so each read batch
is yielded `steps` times; resuming at `cursor` reads from batch `cursor // steps` and skips the
`cursor % steps` steps already taken on it, so a resume reads nothing it would not have read. The step
tells the first use of a batch from the others by the state's step count, not by the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["repeat_reads"]


def repeat_reads(data: Callable[[int, int], Iterator[Any]], steps: int) -> Callable[[int, int], Iterator[Any]]:
    """`data` with each batch yielded `steps` times and cursors counted in those steps; `data` itself
    when `steps` is 1. Closing the returned iterator closes the inner one (its workers and threads)."""
    if type(steps) is not int or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if steps == 1:
        return data

    def repeated(epoch: int, cursor: int) -> Iterator[Any]:
        return _repeat(data(epoch, cursor // steps), steps, skip=cursor % steps)

    return repeated


def _repeat(batches: Iterator[Any], steps: int, skip: int) -> Iterator[Any]:
    try:
        for batch in batches:
            for _ in range(skip, steps):
                yield batch
            skip = 0
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
