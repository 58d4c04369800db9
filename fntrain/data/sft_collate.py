"""The supervised fine-tuning collate: samples -> one micro-batch, padded or packed.

Padded samples (one example each) are right-padded per micro-batch, with a 2-D attention mask only when
something was padded; packed samples (`fntrain.data.packing`: several examples per window) get the 4-D
block-diagonal causal mask that keeps their examples apart. `fntrain.data.vlm` pads its text with the
same collate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fntrain.config import require_choice, require_int
from fntrain.data.packing import document_causal_mask
from fntrain.data.tokens import IGNORE_INDEX

__all__ = ["PAD_TO", "make_sft_collate"]

PAD_TO = ("longest", "max_length")


def _collate_packed(samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "labels", "position_ids", "document_ids")
    batch = {key: torch.stack([torch.as_tensor(s[key], dtype=torch.long) for s in samples]) for key in keys}
    batch["attention_mask"] = document_causal_mask(batch["document_ids"])
    return batch


def make_sft_collate(
    pad_id: int, *, max_length: int, pad_to: str = "max_length", pad_multiple: int = 1
) -> Callable[[list[Any]], dict[str, torch.Tensor]]:
    """Stack samples into a micro-batch.

    Padded samples: right-padded with `pad_id` (labels IGNORE_INDEX) to `max_length` or to the longest
    sample rounded up to a multiple of `pad_multiple` (at most `max_length`: a few distinct shapes, not
    one per batch, and no compute on padding up to max_length), with a 2-D `attention_mask` (1: real
    token); when nothing needs padding there is no mask,
    which keeps attention on its causal fast path. Packed samples (they carry `document_ids`): stacked
    as they are, plus `attention_mask`, the 4-D boolean block-diagonal causal mask [batch, 1, seq, seq]
    (True: may attend), next to their `position_ids` and `document_ids`.
    """
    require_int("max_length", max_length, min=1)
    require_choice("pad_to", pad_to, PAD_TO)
    require_int("pad_multiple", pad_multiple, min=1)

    def padded_length(longest: int) -> int:
        if pad_to == "max_length":
            return max_length
        return min(-(-longest // pad_multiple) * pad_multiple, max_length)

    def collate(samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if samples and "document_ids" in samples[0]:
            return _collate_packed(samples)
        ids = [torch.as_tensor(s["input_ids"], dtype=torch.long) for s in samples]
        labels = [torch.as_tensor(s["labels"], dtype=torch.long) for s in samples]
        length = padded_length(max(len(t) for t in ids))
        if all(len(t) == length for t in ids):  # nothing to pad: no mask needed
            return {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}
        batch_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        batch_labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), length), dtype=torch.long)
        for row, (sample_ids, sample_labels) in enumerate(zip(ids, labels, strict=True)):
            n = min(len(sample_ids), length)
            batch_ids[row, :n] = sample_ids[:n]
            batch_labels[row, :n] = sample_labels[:n]
            mask[row, :n] = 1
        return {"input_ids": batch_ids, "labels": batch_labels, "attention_mask": mask}

    return collate
