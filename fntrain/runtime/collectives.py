"""`reduce_scalars`: a dict of scalar metrics reduced across ranks with one collective, then read once.

Hooks that report numbers call it on their logging steps only, on every rank (the same steps, the same
names in the same order), so collectives stay in step. Without an initialised process group (or with one
rank) nothing is reduced: the tensor values are stacked and read back with a single host transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["REDUCE_OPS", "reduce_scalars", "exact_dtype"]

REDUCE_OPS = ("mean", "sum", "max", "min")
_HOST_OPS = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}


def exact_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device and its collectives handle it (cpu, cuda), float32 elsewhere.

    Counters (tokens, loss sums) are reduced in it, so counts up to 2**53 stay exact on cpu/cuda.
    """
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def _split(values: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(names of scalar tensors, names of host numbers); anything else is an error naming the metric."""
    tensors, numbers = [], []
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}"
                )
            tensors.append(name)
        elif isinstance(value, (int, float)):
            numbers.append(name)
        else:
            raise TypeError(
                f"metric {name!r} must be a number or a scalar tensor, got {type(value).__name__}"
            )
    return tensors, numbers


def _stack(tensors: list[Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One 1-D tensor of the scalars on `device` in `dtype` (conversions only where needed: this runs on
    every logging step)."""
    parts = []
    for value in tensors:
        if value.dim():
            value = value.reshape(())
        if value.dtype != dtype or value.device != device:
            value = value.to(device=device, dtype=dtype)
        parts.append(value)
    return torch.stack(parts).detach()


def reduce_scalars(
    values: Mapping[str, Any],
    op: str | Mapping[str, str] = "mean",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    group: Any = None,
) -> dict[str, float]:
    """`values` (numbers or one-element tensors) reduced over the ranks of `group`, as host floats.

    `op` is one of mean/sum/max/min for all values, or a mapping name -> op (names it omits use "mean").
    One op: one `all_reduce`; mixed ops: one `all_gather` of the stacked vector, reduced on the host.
    Values are stacked on `device` (default: the first tensor's device, else cpu) in `dtype`; the result
    is read back with one `.tolist()`, the only host sync. Must be called on every rank of `group`, with
    the same names in the same order, when a process group is initialised.
    """
    if not values:
        return {}
    ops = {name: op.get(name, "mean") if isinstance(op, Mapping) else op for name in values}
    for name, name_op in ops.items():
        if name_op not in REDUCE_OPS:
            raise ValueError(f"reduce op for {name!r} must be one of {REDUCE_OPS}, got {name_op!r}")
    tensor_names, number_names = _split(values)
    if device is None:
        device = values[tensor_names[0]].device if tensor_names else torch.device("cpu")
    device = torch.device(device)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1

    if world == 1:  # nothing to reduce: host numbers stay as they are, tensors are read in one transfer
        result = {name: float(values[name]) for name in number_names}
        if len(tensor_names) == 1 or device.type == "cpu":  # one read each costs no more than a stack
            result.update((name, float(values[name])) for name in tensor_names)
        elif tensor_names:
            read = _stack([values[name] for name in tensor_names], device, dtype).tolist()
            result.update(zip(tensor_names, read, strict=True))
        return {name: result[name] for name in values}

    names = tensor_names + number_names
    parts = []
    if tensor_names:
        parts.append(_stack([values[name] for name in tensor_names], device, dtype))
    if number_names:
        parts.append(torch.tensor([float(values[name]) for name in number_names], device=device, dtype=dtype))
    stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
    kinds = {ops[name] for name in names}
    if len(kinds) == 1:
        (kind,) = kinds
        dist.all_reduce(
            stacked, op=getattr(dist.ReduceOp, "SUM" if kind == "mean" else kind.upper()), group=group
        )
        if kind == "mean":
            stacked = stacked / world
    else:
        gathered = [torch.empty_like(stacked) for _ in range(world)]
        dist.all_gather(gathered, stacked, group=group)
        table = torch.stack(gathered)  # (world, names)
        stacked = torch.stack([_HOST_OPS[ops[name]](table[:, index]) for index, name in enumerate(names)])
    result = dict(zip(names, stacked.tolist(), strict=True))
    return {name: result[name] for name in values}
