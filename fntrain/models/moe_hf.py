"""Hugging Face MoE models (Qwen2-MoE, Qwen3-MoE, Mixtral, ...): their router loss in the trained loss.

transformers computes a MoE model's load-balancing loss (`load_balancing_loss_func`, over every layer's
router logits, padding masked by the attention mask) only when the forward is asked for router logits,
and adds `router_aux_loss_coef` x it to the loss it computes from `labels`. fntrain computes its own
token-weighted loss from the logits, so `router_aux_forward` asks for the router logits in training and
returns the logits with that weighted term (`fntrain.models.moe.RouterOutput`); `loss_with_router_aux`
adds it to the cross-entropy, as transformers' own loss does. Evaluation (eval mode) and dense models
get the plain output: the validation loss stays the language-model loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fntrain.models.moe import RouterOutput
from fntrain.step import default_forward

__all__ = ["router_aux_coef", "router_aux_forward"]


def router_aux_coef(model: torch.nn.Module) -> float | None:
    """`config.router_aux_loss_coef` of a transformers MoE model (through DDP's `.module` or a peft
    wrapper); None for a model without one (dense)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    return float(coef) if isinstance(coef, (int, float)) and not isinstance(coef, bool) else None


def router_aux_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> Any:
    """`default_forward`, and for a MoE model in training also its router loss: a `RouterOutput` of
    the logits and `router_aux_loss_coef` x transformers' `aux_loss`."""
    coef = router_aux_coef(model) if model.training else None
    if coef is None:
        return default_forward(model, micro_batch)
    inputs = {key: micro_batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in micro_batch}
    output = model(**inputs, output_router_logits=True)
    aux = getattr(output, "aux_loss", None)
    return RouterOutput(output.logits, coef * aux if aux is not None and coef > 0 else None)
