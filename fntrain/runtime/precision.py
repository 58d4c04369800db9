"""What mixed precision asks of the step (§5): the autocast dtype, the fp16 gradient scaler, and the
context the loss runs in under tensor parallelism. The parameters' own casting is FSDP2's
`MixedPrecisionPolicy`, set where the model is wrapped (`fntrain.runtime.parallel`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.parallel import LOW_PRECISION_DTYPES, ParallelConfig
from fntrain.runtime.runtime import Runtime

__all__ = ["autocast_dtype", "build_grad_scaler", "loss_context"]


def autocast_dtype(config: ParallelConfig) -> torch.dtype | None:
    """The autocast dtype the step should use: bf16/fp16 under none/ddp; None under fsdp2 (its
    MixedPrecisionPolicy casts the parameters instead) or in fp32."""
    if config.mixed_precision == "fp32" or config.strategy == "fsdp2":
        return None
    return LOW_PRECISION_DTYPES[config.mixed_precision]


def build_grad_scaler(config: ParallelConfig, runtime: Runtime) -> Any:
    """A gradient scaler for fp16 (None otherwise): FSDP2's `ShardedGradScaler`, whose inf check is
    all-reduced over the data-parallel group because each rank holds only a shard of the gradients;
    `torch.amp.GradScaler` under none/ddp, where every rank holds the full gradients."""
    if config.mixed_precision != "fp16":
        return None
    if config.strategy == "fsdp2":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        group = data_parallel_group(runtime)
        return ShardedGradScaler(
            device=runtime.device.type, process_group=group if group is not None else dist.group.WORLD
        )
    return torch.amp.GradScaler(runtime.device.type)


def loss_context(runtime: Runtime, config: ParallelConfig) -> Callable[[], contextlib.AbstractContextManager]:
    """The context the loss and its backward run in: torch's `loss_parallel()` when the logits are
    split over the vocabulary (tensor parallelism with `loss_parallel`), else a no-op."""
    if runtime.tp_size > 1 and config.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    return contextlib.nullcontext
