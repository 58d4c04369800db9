"""Counting tokens and samples in nested batches (pure functions over optree pytrees) [S22] [S28].

A global batch is the step's micro-batches: a list (or nested lists/tuples) of micro-batch mappings; a
lone mapping is one micro-batch. Counts stay tensors on the batch's device where they come from tensors,
so counting forces no host sync; `count_batch` is the loop's per-step `count_batch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optree
import torch

__all__ = [
    "IGNORE_INDEX",
    "loss_targets",
    "count_loss_tokens",
    "count_tokens",
    "count_samples",
    "count_batch",
    "micro_batches",
    "is_padding",
]

IGNORE_INDEX = -100

# "index" first: one entry per example where a collate lays an example out in several rows (a
# preference pair's chosen and rejected, fntrain.data.preference_collate), so a pair counts once.
_SAMPLE_KEYS = ("index", "input_ids", "labels", "shift_labels", "attention_mask")


def _is_micro_batch(node: Any) -> bool:
    return isinstance(node, Mapping) or isinstance(node, torch.Tensor)


def micro_batches(batch: Any) -> list[Any]:
    """The micro-batches of a (possibly nested) global batch, in order: every mapping (or bare tensor)
    found walking lists and tuples; a lone mapping is one micro-batch."""
    if isinstance(batch, Mapping):
        return [batch]
    if type(batch) is list and all(type(item) is dict for item in batch):
        return batch  # the pipeline's own shape: skip the tree walk on the per-step path
    return optree.tree_leaves(batch, is_leaf=_is_micro_batch)


def loss_targets(
    micro_batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid) for next-token loss [S22].

    targets = `shift_labels` if present, else `labels[..., 1:]`; valid = target != ignore_index AND
    `loss_mask` (shifted like the labels when it is given for unshifted labels). A mask whose shape differs
    from the labels' is a ValueError.
    """
    if "shift_labels" in micro_batch:
        labels_key, targets = "shift_labels", micro_batch["shift_labels"]
    elif "labels" in micro_batch:
        labels_key, targets = "labels", micro_batch["labels"][..., 1:]
    else:
        raise KeyError("a micro-batch needs `labels` or `shift_labels` to count loss tokens")
    valid = targets != ignore_index
    mask = micro_batch.get("loss_mask")
    if mask is not None:
        expected = tuple(micro_batch[labels_key].shape)
        if tuple(mask.shape) != expected:
            raise ValueError(
                f"loss_mask shape {tuple(mask.shape)} differs from the {labels_key} shape {expected}"
            )
        if labels_key == "labels":
            mask = mask[..., 1:]
        valid = valid & mask.bool()
    return targets, valid


def is_padding(micro_batch: Any) -> Any:
    """The micro-batch's padding flag: `is_padding` as given (a bool or a tensor), False when absent."""
    if isinstance(micro_batch, Mapping):
        return micro_batch.get("is_padding", False)
    return False


def _zero_if_padding(count: Any, padding: Any) -> Any:
    """`count`, or zero for a padding micro-batch; a tensor flag is applied on its device (no sync)."""
    if isinstance(padding, torch.Tensor):
        keep = ~padding.to(torch.bool).any()
        if isinstance(count, torch.Tensor):
            return count * keep.to(device=count.device, dtype=count.dtype)
        return keep.to(torch.int64) * count
    return 0 if padding else count


def count_loss_tokens(micro_batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Valid loss tokens of one micro-batch: a 0-d int64 tensor on the labels' device.

    A micro-batch flagged as padding (`is_padding` true, a bool or a tensor) counts zero tokens.
    """
    _, valid = loss_targets(micro_batch, ignore_index)
    count = valid.sum()
    padding = micro_batch.get("is_padding", False)
    if isinstance(padding, torch.Tensor) or padding:
        count = _zero_if_padding(count, padding)
    return count


def _micro_tokens(micro_batch: Any, ignore_index: int) -> Any:
    """Tokens in one micro-batch, by precedence [S28]: `token_count` > valid labels > a 2-D
    `attention_mask`'s sum > `input_ids.numel()`; padding micro-batches count zero."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch.numel()
    if "token_count" in micro_batch:
        count = micro_batch["token_count"]
    elif "labels" in micro_batch or "shift_labels" in micro_batch:
        return count_loss_tokens(micro_batch, ignore_index)  # applies the padding flag itself
    else:
        mask = micro_batch.get("attention_mask")
        ids = micro_batch.get("input_ids")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            count = mask.sum()
        elif isinstance(ids, torch.Tensor):
            count = ids.numel()
        else:
            count = 0
    padding = micro_batch.get("is_padding", False)
    if isinstance(padding, torch.Tensor) or padding:
        count = _zero_if_padding(count, padding)
    return count


def count_tokens(batch: Any, ignore_index: int = IGNORE_INDEX) -> Any:
    """Tokens in a global batch (sum over its micro-batches): an int, or a 0-d tensor on the batch's device."""
    total: Any = None
    for micro_batch in micro_batches(batch):
        count = _micro_tokens(micro_batch, ignore_index)
        total = count if total is None else total + count
    return 0 if total is None else total


def _leading_dim(micro_batch: Any) -> int:
    if isinstance(micro_batch, torch.Tensor):
        return int(micro_batch.shape[0]) if micro_batch.dim() else 1
    for key in _SAMPLE_KEYS:
        value = micro_batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    for leaf in optree.tree_leaves(micro_batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    return 1


def count_samples(batch: Any) -> int:
    """Samples in a global batch: the leading dimension of each micro-batch's tensors, padding excluded.

    A host-side int read from shapes. A padding flag is honoured when it is a bool or a CPU tensor; a flag
    on an accelerator is not read (that would be a host sync), and its micro-batch is counted.
    """
    samples = 0
    for micro_batch in micro_batches(batch):
        padding = is_padding(micro_batch)
        if isinstance(padding, torch.Tensor):
            if padding.device.type == "cpu" and bool(padding.any()):
                continue
        elif padding:
            continue
        samples += _leading_dim(micro_batch)
    return samples


def count_batch(batch: Any) -> tuple[Any, int]:
    """(tokens, samples) of a global batch: the loop's `count_batch`."""
    return count_tokens(batch), count_samples(batch)
