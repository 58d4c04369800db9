"""What a step minimises by default and how it calls the model: `default_forward` and `causal_lm_loss`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fntrain.data.tokens import IGNORE_INDEX, loss_targets

__all__ = ["default_forward", "causal_lm_loss"]

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def default_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> Any:
    """Call the model with the micro-batch's model inputs as keywords (input_ids, attention_mask, ...)."""
    return model(**{key: micro_batch[key] for key in _MODEL_INPUTS if key in micro_batch})


def causal_lm_loss(
    output: Any, micro_batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid tokens of one micro-batch; 0 when there are none.

    `output` is the logits tensor or an object with `.logits` (Hugging Face). Targets and validity per
    [S22]; the cross-entropy is computed in fp32 whatever the logits' dtype. Logits that are a DTensor
    sharded over the vocabulary (tensor parallelism) need torch's `loss_parallel()` context around this
    call and the backward.
    """
    logits = output.logits if hasattr(output, "logits") else output
    targets, valid = loss_targets(micro_batch, ignore_index)
    if "shift_labels" not in micro_batch:
        # The last position has no next token: its target is padded as ignored rather than the logits
        # sliced, so the logits are read in place (a slice of them would be copied whole by the reshape).
        targets = torch.nn.functional.pad(targets, (0, 1), value=ignore_index)
        valid = torch.nn.functional.pad(valid, (0, 1), value=False)
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1).masked_fill(~valid.reshape(-1), 0),
        reduction="none",
    )
    if hasattr(
        per_token, "to_local"
    ):  # vocabulary-parallel logits under loss_parallel(): a replicated DTensor
        per_token = per_token.to_local()
    valid_flat = valid.reshape(-1)
    # Dividing by max(count, 1) keeps an all-ignored micro-batch at exactly 0 (a plain mean gives NaN).
    return (per_token * valid_flat).sum() / valid_flat.sum().clamp(min=1)
