"""Counting tokens and samples in nested batches (pure functions over optree pytrees) [S22] [S28].

Counts stay device tensors where they come from device data, so counting forces no host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

__all__ = ["IGNORE_INDEX", "loss_targets", "count_loss_tokens", "count_tokens", "count_samples", "count_batch"]

IGNORE_INDEX = -100


def _micro_batches(batch: Any) -> Sequence[Mapping[str, Any]]:
    """A global batch is a sequence of micro-batch mappings; a lone mapping is one micro-batch."""
    return (batch,) if isinstance(batch, Mapping) else batch


def loss_targets(micro_batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid) for next-token loss [S22].

    targets = `shift_labels` if present, else `labels[..., 1:]`; valid = target != ignore_index AND
    `loss_mask` (shifted like the labels). A mask whose shape differs from the labels is a ValueError.
    """
    if "shift_labels" in micro_batch:
        targets = micro_batch["shift_labels"]
        shifted = False
    else:
        targets = micro_batch["labels"][..., 1:]
        shifted = True
    valid = targets != ignore_index
    mask = micro_batch.get("loss_mask")
    if mask is not None:
        expected = micro_batch["shift_labels" if not shifted else "labels"].shape
        if tuple(mask.shape) != tuple(expected):
            raise ValueError(f"loss_mask shape {tuple(mask.shape)} differs from the labels' shape {tuple(expected)}")
        valid = valid & (mask[..., 1:] if shifted else mask).bool()
    return targets, valid


def count_loss_tokens(micro_batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Valid loss tokens of one micro-batch (a 0-d int64 tensor on the labels' device).

    A micro-batch flagged as padding (`is_padding` true) counts zero tokens.
    """
    targets, valid = loss_targets(micro_batch, ignore_index)
    count = valid.sum()
    padding = micro_batch.get("is_padding")
    if padding is not None:
        if isinstance(padding, torch.Tensor):
            count = count * (~padding.bool().any()).to(count.dtype)
        elif padding:
            count = torch.zeros((), dtype=count.dtype, device=count.device)
    return count


def _micro_tokens(micro_batch: Mapping[str, Any]) -> Any:
    """Tokens in one micro-batch, by precedence: token_count > valid labels > attention_mask > input_ids."""
    if "token_count" in micro_batch:
        return micro_batch["token_count"]
    if "labels" in micro_batch or "shift_labels" in micro_batch:
        return count_loss_tokens(micro_batch)
    mask = micro_batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.sum()
    ids = micro_batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    return 0


def count_tokens(batch: Any) -> Any:
    """Tokens in a global batch (sum over its micro-batches); an int or a 0-d tensor."""
    total: Any = 0
    for micro_batch in _micro_batches(batch):
        total = total + _micro_tokens(micro_batch)
    return total


def count_samples(batch: Any) -> int:
    """Samples in a global batch: the leading dimension of the first tensor leaf of each micro-batch."""
    samples = 0
    for micro_batch in _micro_batches(batch):
        if micro_batch.get("is_padding") is True:
            continue
        leaves = [leaf for leaf in optree.tree_leaves(micro_batch) if isinstance(leaf, torch.Tensor) and leaf.dim()]
        samples += int(leaves[0].shape[0]) if leaves else 1
    return samples


def count_batch(batch: Any) -> tuple[Any, int]:
    """(tokens, samples) of a global batch: the loop's `count_batch`."""
    return count_tokens(batch), count_samples(batch)
