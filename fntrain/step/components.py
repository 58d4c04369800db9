"""`Components`: the torch objects a run mutates (parameters, optimizer moments), held in one frozen box.

The step closes over them and the checkpoint saves and restores them; the container itself never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fntrain.step.losses import default_forward

__all__ = ["Components"]


@dataclass(frozen=True)
class Components:
    """The model (already parallelized), its loss, optimizers and LR schedulers (tuples, one or more), and
    how the step calls the model (`forward(model, micro_batch)`, what the evaluation calls too)."""

    model: Any
    loss_fn: Callable[[Any, Any], Any]
    optimizers: tuple[Any, ...]
    schedulers: tuple[Any, ...] = ()
    grad_scaler: Any = None
    forward: Callable[[Any, Any], Any] = default_forward
