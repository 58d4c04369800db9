"""The metrics hook's window: the steps since the last log, folded into the logged `loss` and `grad_norm`.

The logged `loss` is the token-weighted mean over the window's steps (sum of per-token losses over the
sum of loss tokens; a step's weight is its "loss_tokens", the count over all data-parallel ranks that
`make_train_step` returns, or 1 when the step returns none), the logged `grad_norm` the plain mean of
the steps' norms. Per step the window only keeps references to the step's device tensors (no device op,
no host sync, like the throughput meter's token counts); on a logging step they are stacked and reduced
on the device, and the metrics hook reads the result with its one transfer (CPU tensors are read as
host numbers instead: on the CPU a read is no sync, and cheaper than stacking). A window that grows long
(nothing logs for `FOLD_AT` steps) is folded into sums, a device op but still no sync.

Every other metric a step returns (an objective's, e.g. DPO's "rewards/chosen", GRPO's "reward" and
"kl", a MoE's "moe/aux_loss") is the plain mean over the window's steps that report it, as TRL logs
them, kept and reduced like the norms; only the step's own bookkeeping and running counts (`STEP_OWN`:
the learning rate, the skip flag, GRPO's `num_tokens`) are the logging step's values.

Steps whose update was skipped ("skipped" true: skip-non-finite mode) stay out of the means: their loss
may be inf/NaN. The window's state (`window_state` / `load_window_state`, host numbers read at a
checkpoint) lets a resume mid-window log exactly what an uninterrupted run logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fntrain.runtime.collectives import exact_dtype

__all__ = [
    "FOLD_AT", "WEIGHT", "STEP_OWN", "Window", "add_step", "window_means", "window_state", "load_window_state",
    "is_group_metric",
]  # fmt: skip

WEIGHT = "loss_tokens"
"""The step metric that weights the step's loss in the window (consumed by the window, never logged)."""

FOLD_AT = 256
"""Steps the window keeps by reference before folding them into sums (a device op, no sync)."""

_STATE_KEYS = ("loss_sum", "loss_weight", "grad_norm_sum", "grad_norm_steps")


@dataclass(slots=True)
class Window:
    """The steps since the last log: per-step references, plus sums already folded or restored."""

    losses: list[Any] = field(default_factory=list)  # each step's loss (device tensors, as returned)
    weights: list[Any] = field(default_factory=list)  # each step's loss tokens (or 1)
    norms: list[Any] = field(default_factory=list)  # each step's grad_norm
    loss_sum: Any = 0.0  # sum of loss x weight of the steps folded or restored
    loss_weight: Any = 0.0
    grad_norm_sum: Any = 0.0  # sum of the norms folded or restored
    grad_norm_steps: int = 0  # steps with a grad_norm in the window (folded and restored ones included)
    tensor_losses: bool = False  # a step returned its loss as a tensor (then the mean is one: reduced)
    tensor_norms: bool = False
    grouped: dict[str, list[Any]] = field(default_factory=dict)  # each "/" metric's per-step values
    grouped_sums: dict[str, float] = field(default_factory=dict)  # their sums folded or restored ...
    grouped_steps: dict[str, int] = field(default_factory=dict)  # ... and the steps behind those sums
    group_names: tuple[str, ...] = ()  # the grouped names among the step's metrics ...
    names_of: int = -1  # ... found in a step of this many metrics


STEP_OWN = ("loss", "grad_norm", WEIGHT, "lr", "skipped", "num_tokens", "consumed_tokens", "consumed_samples")
"""The step's own metrics and running counts: the loss and norm have their own means, the rest are the
logging step's (a rate it used, a flag, a count so far)."""


def is_group_metric(name: str) -> bool:
    """Whether a step metric is averaged over the window's steps: all but the step's own (`STEP_OWN`)."""
    return name not in STEP_OWN


def add_step(window: Window, metrics: Mapping[str, Any]) -> None:
    """Keep one step's loss, weight and grad_norm by reference (no device op until `FOLD_AT` steps)."""
    if metrics.get("skipped") or "loss" not in metrics:
        return
    window.losses.append(metrics["loss"])
    window.weights.append(metrics.get(WEIGHT, 1))
    norm = metrics.get("grad_norm")
    if norm is not None:
        window.norms.append(norm)
        window.grad_norm_steps += 1
    if len(metrics) != window.names_of:  # a step's metric names are fixed: found once, not every step
        window.group_names, window.names_of = tuple(filter(is_group_metric, metrics)), len(metrics)
    for name in window.group_names:
        window.grouped.setdefault(name, []).append(metrics[name])
    if len(window.losses) >= FOLD_AT:
        _fold(window)


def _on_device(items: list[Any]) -> bool:
    """Whether every item is a tensor off the CPU. CPU tensors are read as host numbers instead: on the
    CPU a read is no sync, and a few reads cost a fraction of stacking them (bench/RESULTS.md)."""
    return all(isinstance(item, torch.Tensor) and item.device.type != "cpu" for item in items)


def _vector(items: list[Any]) -> torch.Tensor:
    """Scalar tensors as one 1-D tensor in the exact dtype of their device (float64 on cuda)."""
    stacked = torch.stack(items)
    return stacked.to(exact_dtype(stacked.device))


def _loss_sums(losses: list[Any], weights: list[Any]) -> tuple[Any, Any]:
    """(sum of loss x weight, sum of weights): on the device for device tensors, else on the host."""
    if _on_device(losses):
        if _on_device(weights):
            vector, weight = _vector(losses), _vector(weights)
            return (vector * weight).sum(), weight.sum()
        if all(weight.__class__ is int and weight == 1 for weight in weights):
            return _vector(losses).sum(), len(losses)  # unweighted steps: a plain mean
    return sum(float(x) * float(w) for x, w in zip(losses, weights, strict=True)), sum(map(float, weights))


def _norm_sum(norms: list[Any]) -> Any:
    if norms and _on_device(norms):
        return _vector(norms).sum()
    return sum(float(norm) for norm in norms)  # host floats (0.0 when not clipping) or CPU tensors


def _sums(window: Window) -> tuple[Any, Any, Any]:
    """(sum of loss x weight, sum of weights, sum of norms) over the whole window."""
    window.tensor_losses = window.tensor_losses or any(isinstance(x, torch.Tensor) for x in window.losses)
    window.tensor_norms = window.tensor_norms or any(isinstance(x, torch.Tensor) for x in window.norms)
    loss_sum, loss_weight = window.loss_sum, window.loss_weight
    if window.losses:
        step_sum, step_weight = _loss_sums(window.losses, window.weights)
        loss_sum, loss_weight = loss_sum + step_sum, loss_weight + step_weight
    return loss_sum, loss_weight, window.grad_norm_sum + _norm_sum(window.norms)


def _grouped_sums(window: Window) -> dict[str, tuple[Any, int]]:
    """Each grouped metric's (sum, steps) over the whole window: a device sum for device tensors."""
    sums = {name: (window.grouped_sums.get(name, 0.0), window.grouped_steps.get(name, 0))
            for name in {*window.grouped_sums, *window.grouped}}  # fmt: skip
    for name, values in window.grouped.items():
        total, steps = sums[name]
        sums[name] = (total + _norm_sum(values), steps + len(values))
    return sums


def _fold(window: Window) -> None:
    steps = window.grad_norm_steps
    for name, (total, count) in _grouped_sums(window).items():
        window.grouped_sums[name], window.grouped_steps[name] = total, count
    window.grouped.clear()
    window.loss_sum, window.loss_weight, window.grad_norm_sum = _sums(window)
    window.losses.clear()
    window.weights.clear()
    window.norms.clear()
    window.grad_norm_steps = steps


def _as_metric(value: Any, tensor: bool) -> Any:
    """A mean computed on the host from tensors goes back into a tensor, so the hook reduces it over ranks
    (only asked for when there are ranks to reduce over)."""
    if tensor and not isinstance(value, torch.Tensor):
        return torch.tensor(value, dtype=torch.float64)
    return value


def window_means(window: Window, reduced: bool = True) -> dict[str, Any]:
    """The window's "loss" (token-weighted mean) and "grad_norm" (mean): tensors where the steps gave
    device tensors (no sync here: the caller reads them), host numbers where they gave numbers or CPU
    tensors, those put back in tensors when `reduced` (the caller reduces tensors over ranks); a mean with
    no step behind it is left out. Resets the window."""
    loss_sum, loss_weight, norm_sum = _sums(window)
    means: dict[str, Any] = {}
    if isinstance(loss_weight, torch.Tensor):
        # A window of zero-token steps has zero loss (the step's rule), so 0 / 1 keeps it at 0.
        means["loss"] = loss_sum / loss_weight.clamp(min=1)
    elif window.tensor_losses or window.losses or loss_weight:
        mean = loss_sum / loss_weight if loss_weight else 0.0
        means["loss"] = _as_metric(mean, reduced and window.tensor_losses)
    if window.grad_norm_steps:
        means["grad_norm"] = _as_metric(norm_sum / window.grad_norm_steps, reduced and window.tensor_norms)
    for name, (total, steps) in sorted(_grouped_sums(window).items()):
        if steps:  # a tensor when the steps gave tensors (reduced over ranks by the caller), like the norms
            means[name] = _as_metric(total / steps, reduced)
    reset(window)
    return means


def reset(window: Window) -> None:
    """Start a new window."""
    window.losses.clear()
    window.weights.clear()
    window.norms.clear()
    window.loss_sum = window.loss_weight = window.grad_norm_sum = 0.0
    window.grad_norm_steps = 0
    window.tensor_losses = window.tensor_norms = False
    window.grouped.clear()
    window.grouped_sums.clear()
    window.grouped_steps.clear()


def window_state(window: Window) -> dict[str, float]:
    """The window as host numbers (JSON): reads the device, so only when a checkpoint is saved."""
    loss_sum, loss_weight, norm_sum = _sums(window)
    return {
        "loss_sum": float(loss_sum),
        "loss_weight": float(loss_weight),
        "grad_norm_sum": float(norm_sum),
        "grad_norm_steps": window.grad_norm_steps,
        **({"grouped": {name: [float(total), count] for name, (total, count) in sorted(grouped.items())}}
           if (grouped := _grouped_sums(window)) else {}),
    }  # fmt: skip


def load_window_state(window: Window, saved: Mapping[str, Any]) -> None:
    """Continue the window `window_state` saved (its sums become the folded part)."""
    missing = [key for key in _STATE_KEYS if key not in saved]
    if missing:
        raise ValueError(f"metrics state is missing {missing}, got keys {sorted(saved)}")
    reset(window)
    window.loss_sum, window.loss_weight = float(saved["loss_sum"]), float(saved["loss_weight"])
    window.grad_norm_sum, window.grad_norm_steps = (
        float(saved["grad_norm_sum"]),
        int(saved["grad_norm_steps"]),
    )
    for name, (total, count) in saved.get("grouped", {}).items():  # absent: a window without them
        window.grouped_sums[name], window.grouped_steps[name] = float(total), int(count)
