"""The throughput meter's interval: this rank's steps since the last logging step, counted per step with
no device op and reduced over the ranks in one collective on a logging step.

`add_step` adds a step's host time, samples and tokens (a few integer and float additions; a token count
that is a device tensor is kept by reference, and `FOLD_AT` of them are summed into one, a device op but
no sync, only when nothing logs for long). `reduce_interval` synchronises the device (the wait is added
to the step time, so queued device work is counted), reduces the interval's sums with one collective and
starts a new interval. Counts restored from a checkpoint, or left unreduced by an earlier run on the
same hook, are carried: they are consumed, but not part of this interval's rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fntrain.runtime.collectives import exact_dtype, reduce_scalars

__all__ = ["FOLD_AT", "Interval", "add_step", "local_tokens", "carry_over", "restart", "reduce_interval"]

FOLD_AT = 256
"""Tensor token counts kept by reference before they are summed into one (bounds memory when nothing logs)."""

_GIB = float(2**30)


@dataclass(slots=True)
class Interval:
    """This rank's steps since the last logging step, plus the counts carried into it."""

    busy: float = 0.0  # host seconds inside steps since the last logging step (this rank)
    steps: int = 0
    samples: int = 0
    tokens: int = 0  # integer token counts since the last logging step
    token_tensors: list[Any] = field(default_factory=list)  # tensor token counts, summed when reduced
    carry_tokens: int = 0  # restored counts of steps a checkpoint had not yet reduced
    carry_samples: int = 0


def add_step(interval: Interval, info: Any) -> None:
    """Add one step (a `StepInfo`) to the interval (no device op: a tensor token count is kept by
    reference)."""
    interval.busy += info.step_time_s
    interval.steps += 1
    interval.samples += info.samples
    count, token_tensors = info.tokens, interval.token_tensors
    if count.__class__ is int:
        interval.tokens += count
    elif isinstance(count, torch.Tensor):
        token_tensors.append(count)
        if len(token_tensors) >= FOLD_AT:  # a device op, no sync: only when nothing logs for long
            folded = torch.stack(token_tensors).sum()
            token_tensors.clear()
            token_tensors.append(folded)
    else:
        interval.tokens += int(count)


def local_tokens(interval: Interval) -> int:
    """This rank's tokens since the last logging step (reads the device: logging steps only)."""
    if interval.token_tensors:
        return interval.tokens + int(torch.stack(interval.token_tensors).sum())
    return interval.tokens


def restart(interval: Interval) -> None:
    """Drop the interval's steps (the carried counts stay)."""
    interval.busy, interval.steps, interval.samples, interval.tokens = 0.0, 0, 0, 0
    interval.token_tensors.clear()


def carry_over(interval: Interval) -> None:
    """Carry the interval's unreduced counts (consumed, but not this run's rate) and restart it."""
    interval.carry_tokens += local_tokens(interval)
    interval.carry_samples += interval.samples
    restart(interval)


def reduce_interval(
    interval: Interval, module: Any, device: torch.device, with_memory: bool
) -> tuple[dict[str, Any], int]:
    """(the interval's sums reduced over the ranks, its steps), after a device sync when `module`
    (torch.cuda, ...) is given; "peak_mem_gib" too when `with_memory`. Starts a new interval, carried
    counts included (they are in the sums)."""
    if module is not None:
        started = time.perf_counter()
        module.synchronize()  # the steps' queued device work belongs to their time
        interval.busy += time.perf_counter() - started
    steps = interval.steps
    values: dict[str, Any] = {
        "tokens": local_tokens(interval),
        "samples": interval.samples,
        "carry_tokens": interval.carry_tokens,
        "carry_samples": interval.carry_samples,
        "step_time_s": interval.busy / steps if steps else 0.0,
    }
    ops = {"step_time_s": "max"}
    if with_memory:
        values["peak_mem_gib"] = module.max_memory_allocated(device) / _GIB
        ops["peak_mem_gib"] = "max"
    reduced = reduce_scalars(values, ops, device=device, dtype=exact_dtype(device))
    restart(interval)
    interval.carry_tokens = interval.carry_samples = 0
    return reduced, steps
