"""Moving nested batches (dicts, lists, tuples, namedtuples of tensors) to a device, with optree.

Host-to-accelerator copies are issued with `non_blocking=True`: from pinned memory they overlap with
compute; from pageable memory the runtime stages them and they behave like blocking copies, so the flag is
always safe there. Copies *to* the host are never non-blocking (the host would read memory that is still
being written). Pinning costs a host copy, so it only helps off the critical path: `pin_memory` is meant
for a background thread (the prefetcher or the DataLoader's pin thread), never for the step itself.
Containers optree does not know (custom classes) are left as they are; non-tensor leaves pass through.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

__all__ = ["to_device", "pin_memory", "can_pin_memory"]


def can_pin_memory() -> bool:
    """True when an accelerator is present, so page-locked host memory exists and speeds up copies to it."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def to_device(batch: Any, device: torch.device | str, *, non_blocking: bool = True) -> Any:
    """`batch` with every tensor leaf moved to `device` (same structure; leaves already there are kept).

    `non_blocking` applies only to host-to-accelerator copies (see the module docstring).
    """
    device = torch.device(device)
    async_ok = non_blocking and device.type not in ("cpu", "meta")

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.to(device, non_blocking=async_ok and leaf.device.type == "cpu")

    return optree.tree_map(move, batch)


def pin_memory(batch: Any) -> Any:
    """`batch` with its host tensors in page-locked memory; unchanged when no accelerator is present."""
    if not can_pin_memory():
        return batch

    def pin(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and not leaf.is_pinned():
            return leaf.pin_memory()
        return leaf

    return optree.tree_map(pin, batch)
