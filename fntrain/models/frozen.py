"""A second model that does not train beside the one that does: a DPO reference, a KD teacher.

    check_companion("dpo.reference_path", reference_dir, model, assets)  # phase 1: a causal LM, same vocabulary
    frozen = load_frozen_causal_lm(HFModelConfig(path=...), runtime, parallel)  # sharded like the policy

The frozen model is loaded like the trained one (`fntrain.models.hf.load_causal_lm`, so under fsdp2 it
is sharded over the same ranks and no rank holds it whole), then switched to eval mode with every
parameter's `requires_grad` off and its dropout at 0 (TRL does the same to its reference). Under ddp it
is not wrapped: DDP refuses a module with nothing to train, and every rank holds a replica anyway.
"""

from __future__ import annotations

from typing import Any

import torch

from fntrain.config import ConfigError
from fntrain.models.hf import ModelAssets, load_causal_lm, load_pretrained, load_tokenizer
from fntrain.models.hf_config import HFModelConfig, model_vocab_size, require_model_dir, require_model_kind
from fntrain.step.objectives import disable_dropout

__all__ = ["check_companion", "load_frozen_causal_lm", "freeze"]


def check_companion(field_name: str, path: str, model: HFModelConfig, assets: ModelAssets) -> None:
    """Before any weight is loaded: `path` (given as `field_name`) is a causal-LM directory whose
    vocabulary is the trained model's: the same config vocab_size (logits of one width) and, when it
    holds a tokenizer, the same token -> id table. Anything else is a `ConfigError` naming the field."""
    require_model_dir(field_name, path)
    require_model_kind(field_name, path, "causal_lm")
    ours, theirs = model_vocab_size(model), model_vocab_size(HFModelConfig(path=path))
    if ours != theirs:
        raise ConfigError(
            f"{field_name} {path!r} has a vocabulary of {theirs} tokens, the trained model (model.path) "
            f"{ours}: the two must share one tokenizer"
        )
    try:
        tokenizer = load_tokenizer(field_name, path)
    except ConfigError:
        return  # no tokenizer of its own there: the sizes are what can be compared
    if tokenizer.get_vocab() != assets.tokenizer.get_vocab():
        raise ConfigError(
            f"{field_name} {path!r} has another tokenizer than the trained model's (model.path): the "
            "same ids would mean other tokens"
        )


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode, nothing trainable, every dropout at p=0; returned for chaining."""
    model.eval()
    model.requires_grad_(False)
    return disable_dropout(model)


def load_frozen_causal_lm(config: HFModelConfig, runtime: Any, parallel: Any) -> torch.nn.Module:
    """The causal LM of `config.path`, placed like the trained model and frozen (see the module
    docstring): fsdp2 shards it over the same ranks, ddp and none hold it whole on each rank."""
    if parallel.strategy == "ddp":
        return freeze(load_pretrained(config, runtime.device))
    return freeze(load_causal_lm(config, runtime, parallel))
