"""The metrics hook: on each logging step, the metrics since the last log reduced across ranks and
written (rank 0).

Conventions (docs: README, "Metrics"): `loss` is the token-weighted mean over the steps since the last
log (sum of per-token losses over the loss tokens of those steps, all ranks), `grad_norm` the plain mean
of those steps' norms, `loss_last` (log_every > 1) the logging step's own loss, `lr` the rate the
logging step used; every other step metric is the logging step's. The window is `fntrain.hooks.metrics_window`: per step
it keeps references to the step's device tensors (no device op, no host sync). On a logging step every
rank asks its sources (other hooks' figures, e.g. the throughput meter's, each a function passed in
explicitly), reduces the window on the device, stacks the tensor metrics and reduces them with one
all_reduce (mean over ranks: the step's token-weighted loss is defined so that this mean is the global
loss), reads them with one host transfer, and writes the merged record through the run's `MetricsLog`
(`fntrain.hooks.metrics_log`; where records go: `fntrain.hooks.sinks`). The window is the hook's
checkpointed state (name "metrics"), so a resume mid-window logs what an uninterrupted run logs. The log
is stopped at TRAIN_END and ABORT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fntrain.config import require_int
from fntrain.hooks.base import cadence
from fntrain.hooks.metrics_log import RESERVED, MetricsLog
from fntrain.hooks.metrics_window import (
    WEIGHT,
    Window,
    add_step,
    load_window_state,
    window_means,
    window_state,
)
from fntrain.hooks.sinks import MetricsConfig, check_metric_packages
from fntrain.loop import Event, Hook, StepInfo
from fntrain.runtime.collectives import reduce_scalars
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from fntrain.stateful import stateful

__all__ = [
    "MetricsConfig",
    "MetricSource",
    "check_metric_packages",
    "is_logging_step",
    "metrics_hook",
]

MetricSource = Callable[[], Mapping[str, float]]
"""Host numbers another hook adds to a logging step's record; called on every rank on each logging step
(it may take part in a collective), after the hooks before the metrics hook saw the step."""


def is_logging_step(step: int, log_every: int, last_step: int | None = None) -> bool:
    """Whether `step` logs: a multiple of `log_every` (0 = never), or the run's last step when given."""
    return log_every > 0 and cadence(log_every, last_step)(step)


def metrics_hook(
    runtime: Runtime,
    *,
    log_every: int,
    writer: MetricsLog,
    sources: Sequence[MetricSource] = (),
    last_step: int | None = None,
) -> Hook:
    """The metrics hook (a stateful hook named "metrics"): logging steps are the multiples of
    `log_every` and `last_step` (log_every 0: no step logs). Every step joins the window (references
    only); on each logging step, on every rank, merge the `sources`' figures with the window's means and
    the step's metrics reduced over ranks (mean, one collective) and write the record (rank 0). Stops
    `writer` (its sinks get the summary and are closed) at TRAIN_END and ABORT (outcome "aborted"); the
    run that built `writer` sends it the end-of-run summary itself.

    Tensor metrics must be scalars; Python numbers (lr) are host values the step computes identically on
    every rank and are logged as they are. "loss_tokens" weights the window's loss and is not logged. A
    metric named twice (by the step and a source, or by two sources), or named "step", "epoch" or
    "attempt", is a `ValueError`.
    """
    require_int("log_every", log_every, min=0)
    if last_step is not None:
        require_int("last_step", last_step, min=1)
    device, across_ranks = runtime.device, runtime.world_size > 1
    due = cadence(log_every, last_step) if log_every else None
    window = Window()
    keep_last = log_every > 1  # with one step per log, loss_last would repeat loss

    def metrics(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            if due is None:
                return
            add_step(window, info.metrics)
            if due(state.global_step):
                record = _record(state, info, window, sources, device, keep_last, across_ranks)
                writer.write(state.global_step, state.epoch, record)
        elif event is Event.TRAIN_END:
            writer.stop()
        elif event is Event.ABORT:
            writer.stop(outcome="aborted")

    return stateful(
        "metrics", metrics, lambda: window_state(window), lambda saved: load_window_state(window, saved)
    )


def _step_metrics(info: StepInfo, window: Window, keep_last: bool, across_ranks: bool) -> dict[str, Any]:
    """The logging step's metrics with the window's means for loss and grad_norm (the step's own loss
    kept as loss_last when `keep_last`) and without the window's weight; `across_ranks`: there are ranks to
    reduce the means over."""
    metrics = {name: value for name, value in info.metrics.items() if name != WEIGHT}
    for name in ("loss", "grad_norm"):  # the window's mean would hide a non-scalar: checked here
        value = metrics.get(name)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
    if keep_last and "loss" in metrics:
        metrics["loss_last"] = metrics["loss"]
    metrics.update(window_means(window, reduced=across_ranks))
    return metrics


def _record(
    state: TrainState,
    info: StepInfo,
    window: Window,
    sources: Sequence[MetricSource],
    device: torch.device,
    keep_last: bool,
    across_ranks: bool,
) -> dict[str, float]:
    """The record of one logging step: the sources' figures (asked first, in order, so every rank takes
    their collectives in the same order), then the window's means and the step's metrics reduced over
    ranks."""
    posted: dict[str, float] = {}
    for source in sources:
        for name, value in source().items():
            if name in posted:
                raise ValueError(f"metric {name!r} was posted twice for step {state.global_step}")
            posted[name] = value
    metrics = _step_metrics(info, window, keep_last, across_ranks)
    tensors = {name: value for name, value in metrics.items() if isinstance(value, torch.Tensor)}
    reduced = reduce_scalars(tensors, "mean", device=device)
    record: dict[str, float] = {}
    for name, value in metrics.items():
        if name in reduced:
            record[name] = reduced[name]
        elif isinstance(value, (int, float)):
            record[name] = float(value)
        else:
            kind = type(value).__name__
            raise TypeError(f"metric {name!r} must be a number or a scalar tensor, got {kind}")
    for name, value in posted.items():
        if name in record:
            raise ValueError(f"metric name collision: {name!r} is both a step metric and a hook metric")
        record[name] = value
    for name in RESERVED:
        if name in record:
            raise ValueError(f"metric name collision: {name!r} is reserved for the record's position")
    return record
