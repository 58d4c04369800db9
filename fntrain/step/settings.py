"""`StepSettings`: how a step runs, apart from what it trains (one frozen record for both step builders)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.data.tokens import IGNORE_INDEX

__all__ = ["StepSettings", "LOSS_WEIGHTINGS", "NONFINITE_MODES", "AUTOCAST_DTYPES", "check_settings"]

LOSS_WEIGHTINGS = ("token", "mean")
NONFINITE_MODES = ("raise", "skip")
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StepSettings:
    """The step's numbers, device and process group (`make_train_step` says what each one does).

    The run derives them once from its configs and runtime (`fntrain.step.layouts`); a step built by
    hand passes only what differs from these defaults."""

    max_grad_norm: float = 0.0
    """> 0 clips the gradients to this norm; the step reports the pre-clip norm (else 0) [S24]."""
    loss_weighting: str = "token"
    """"token": each micro-batch weighted by its share of the step's valid tokens [S23]; "mean": plain mean."""
    nonfinite: str = "raise"
    """A non-finite loss (or clipped norm): "raise" an error naming the step, or "skip" the update."""
    device: torch.device | None = None
    """Where micro-batches are moved (None: the first trainable parameter's device)."""
    dp_size: int = 1
    """Ranks whose gradients DDP / FSDP2 average (`gradient_group_size(runtime)`)."""
    dp_group: Any = None
    """Their process group (`data_parallel_group(runtime)`); None is the default group."""
    autocast_dtype: torch.dtype | None = None
    """bf16 / fp16: the forward runs under autocast."""
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Wraps every forward, loss and backward (vocabulary-parallel loss needs `loss_parallel()`)."""
    ignore_index: int = IGNORE_INDEX
    """The label of a position that carries no loss."""


def check_settings(settings: StepSettings) -> None:
    """Each setting's type and range: a ValueError naming it (at build time, never per step)."""
    max_grad_norm, dp_size, autocast_dtype = settings.max_grad_norm, settings.dp_size, settings.autocast_dtype
    if settings.loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {settings.loss_weighting!r}")
    if settings.nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {settings.nonfinite!r}")
    if not isinstance(max_grad_norm, (int, float)) or isinstance(max_grad_norm, bool) or max_grad_norm < 0:
        raise ValueError(f"max_grad_norm must be a number >= 0, got {max_grad_norm!r}")
    if type(dp_size) is not int or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    if autocast_dtype is not None and autocast_dtype not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype!r}"
        )
