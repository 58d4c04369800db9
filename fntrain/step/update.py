"""The end of a step, shared by the micro-batch and pipeline steps: unscale and clip the gradients,
step the optimizers and schedulers [S24] [S25], and gather the step's metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["current_lr"]


def current_lr(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> float:
    """Max of the schedulers' last lr, else max param-group lr [S29] (host floats: no sync)."""
    if schedulers:
        return max(max(s.get_last_lr()) for s in schedulers)
    return max(group["lr"] for opt in optimizers for group in opt.param_groups)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (FSDP2's grad norm); plain tensors unchanged."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _make_unscale_and_clip(
    params: list[torch.Tensor],
    optimizers: tuple[torch.optim.Optimizer, ...],
    max_grad_norm: float,
    grad_scaler: Any,
) -> Callable[[], Any]:
    """`unscale_and_clip() -> grad_norm`: unscale the gradients when a scaler is in use, then clip when
    max_grad_norm > 0 and return the pre-clip norm; 0.0 when not clipping [S24]."""
    clip = max_grad_norm > 0

    def unscale_and_clip() -> Any:
        if grad_scaler is not None:
            for optimizer in optimizers:
                grad_scaler.unscale_(optimizer)
        if clip:
            return _clip_grad_norm(groups, max_grad_norm)
        return 0.0  # a host float costs no device op

    groups = _by_mesh(params)
    return unscale_and_clip


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters grouped by the DeviceMesh they are DTensors on (plain tensors: one group)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return list(groups.values())


def _total_grad_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of every gradient of `groups`, each group's norm made whole first."""
    norms = [
        _full(torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], foreach=None))
        for group in groups
    ]
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def _clip_grad_norm(groups: list[list[torch.Tensor]], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over all groups; the pre-clip total norm. DTensors on different meshes
    (expert weights sharded over ep x dp beside the dense ones over dp) cannot meet in one norm, so
    each mesh's norm is made whole and the total combined from those (what torchtitan does for ep)."""
    if len(groups) == 1:
        return _full(torch.nn.utils.clip_grad_norm_(groups[0], max_norm, foreach=None))
    from torch.distributed.tensor.experimental import implicit_replication

    total = _total_grad_norm(groups)
    with implicit_replication():  # the total is a plain tensor; the grads are DTensors
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=None)
    return total


def _make_update(
    optimizers: tuple[torch.optim.Optimizer, ...],
    schedulers: tuple[Any, ...],
    grad_scaler: Any,
    skip_mode: bool,
    step_end: Callable[[], Mapping[str, Any]] | None = None,
) -> Callable[[torch.Tensor, Any, bool], dict[str, Any]]:
    """`update(reported, grad_norm, skip, loss_tokens) -> metrics`: step the optimizers (unless `skip`),
    zero the gradients, step the schedulers (unless `skip`) [S25], and gather the step's metrics: "lr"
    is the rate this step's update used (read before the schedulers step, a host float: no sync);
    "loss_tokens" (token mode) the step's loss-token count over all data-parallel ranks, as given."""

    def update(reported: torch.Tensor, grad_norm: Any, skip: bool, loss_tokens: Any = None) -> dict[str, Any]:
        lr = current_lr(optimizers, schedulers)  # the rate this step uses: read before the schedulers step
        if not skip:
            for optimizer in optimizers:
                if grad_scaler is not None:
                    grad_scaler.step(optimizer)
                else:
                    optimizer.step()
        if grad_scaler is not None:
            grad_scaler.update()  # also after a skipped step: unscale_ must be followed by update
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if not skip:
            for scheduler in schedulers:
                scheduler.step()
        metrics: dict[str, Any] = {
            "loss": reported,
            "grad_norm": grad_norm,
            "lr": lr,
        }
        if loss_tokens is not None:
            metrics["loss_tokens"] = loss_tokens
        if skip_mode:
            metrics["skipped"] = float(skip)
        if step_end is not None:
            extra = step_end()
            if clash := sorted(set(extra) & set(metrics)):
                raise ValueError(f"step_end metrics {clash} collide with the step's own")
            metrics.update(extra)
        return metrics

    return update
