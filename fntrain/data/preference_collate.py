"""The preference collate: example dicts of chosen/rejected pairs -> one micro-batch of 2B sequences, so
one forward computes the log-probs of both (`fntrain.data.preference` builds the examples).

Rows 0..B-1 are the chosen sequences and rows B..2B-1 the rejected ones, in the examples' order, as in
TRL's `DataCollatorForPreference`: right-padded with the pad id to the longest sequence of the batch
(rounded up to `pad_multiple`), an `attention_mask` (1: real token) and `labels` IGNORE_INDEX on prompt and
padding tokens. Padding is masked and its labels ignored, so it changes no log-prob.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fntrain.config import require_int
from fntrain.data.tokens import IGNORE_INDEX

__all__ = ["make_preference_collate"]


def make_preference_collate(
    pad_id: int, *, pad_multiple: int = 1
) -> Callable[[Sequence[Mapping[str, Any]]], dict[str, torch.Tensor]]:
    """A collate of B preference examples -> {"input_ids": (2B, T) long, "attention_mask": (2B, T) long
    1/0, "labels": (2B, T) long, "index": (B,) long}: chosen rows first, then rejected, right-padded to
    T = the longest sequence rounded up to a multiple of `pad_multiple`."""
    require_int("pad_id", pad_id, min=0)
    require_int("pad_multiple", pad_multiple, min=1)

    def collate(examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("the preference collate needs at least one example")
        sequences = [
            (e[f"{side}_input_ids"], e[f"{side}_labels"]) for side in ("chosen", "rejected") for e in examples
        ]
        longest = max(len(ids) for ids, _ in sequences)
        length = -(-longest // pad_multiple) * pad_multiple
        input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (ids, row_labels) in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            labels[row, : len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        index = torch.as_tensor([e["index"] for e in examples], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "index": index}

    return collate
