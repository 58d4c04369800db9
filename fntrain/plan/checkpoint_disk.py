"""The disk a run's checkpoints take, for `fntrain plan`: one checkpoint from the model's size and its
optimizer's state, and how many can exist at once under the retention settings. An estimate, and the
plan says so.

    checkpoint_bytes(config, model)          one checkpoint: weights + optimizer state, in bytes
    checkpoints_at_once(saves, keep_last, keep_best)   the most complete or in-flight checkpoints at once
    checkpoint_size(config, model_factory)   checkpoint_bytes of the model built on the meta device

What is assumed: every tensor of the model's state dict is saved in fp32 (a tied weight under each of
its names, as DCP writes it), and the optimizer holds fp32 states for each trainable parameter (AdamW:
two and its step count, SGD with momentum: one). Headers: about 1.8 KiB per saved tensor (DCP's record
and its metadata entry) and 32 KiB of JSON (meta.json, a rank's state), measured on fntrain's own
checkpoints (within 1% for the tiny GPT and a tiny Llama; nothing next to a large model's weights).
A model trained in bf16 parameters takes half the weights and states counted here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["checkpoint_bytes", "checkpoints_at_once", "checkpoint_size"]

_BYTES = 4  # fp32 weights and optimizer states (as fntrain.plan.estimate assumes)
_PER_TENSOR = 1843  # DCP's bytes per saved tensor beyond its data: the record in the .distcp file, .metadata
_JSON = 32 * 1024  # meta.json, rank_<r>.json, manifest.json, COMPLETE


def checkpoint_bytes(config: Any, model: Any) -> dict[str, Any]:
    """The bytes one checkpoint of `model` (built on the meta device) takes under `config`'s optimizer:
    {"weights", "optimizer_state", "headers", "total", "optimizer"} (and "notes")."""
    tensors = list(model.state_dict().values())
    trained = [param for param in model.parameters() if param.requires_grad]
    optim = getattr(config, "optim", None)
    name = getattr(optim, "name", "adamw")
    states = 2 if name == "adamw" else (1 if getattr(optim, "momentum", 0.0) else 0)
    saved = len(tensors) + len(trained) * (states + (name == "adamw"))  # AdamW's step is a tensor too
    weights = sum(tensor.numel() for tensor in tensors) * _BYTES
    optimizer_state = sum(param.numel() for param in trained) * states * _BYTES
    headers = saved * _PER_TENSOR + _JSON
    section: dict[str, Any] = {
        "weights": weights,
        "optimizer_state": optimizer_state,
        "headers": headers,
        "total": weights + optimizer_state + headers,
        "optimizer": name,
    }
    if getattr(getattr(config, "lora", None), "enabled", False):
        section["notes"] = ["LoRA trains the adapters alone: their optimizer state is far less than counted here"]
    return section


def checkpoints_at_once(saves: int, keep_last: int, keep_best: bool, *, timed: bool = False) -> int | None:
    """The most checkpoints on disk at once over a run of `saves` saves (`timed`: more come from
    save_every_minutes, how many is not known): all of them without keep_last (None when timed), else the
    newest keep_last, the best by val_loss beside them (`keep_best`: evaluation runs), and the one being
    written before retention deletes the oldest."""
    if keep_last <= 0:
        return None if timed else saves
    limit = keep_last + int(keep_best) + 1
    return limit if timed else min(saves, limit)


def checkpoint_size(config: Any, model_factory: Any) -> dict[str, Any] | None:
    """`checkpoint_bytes` of `model_factory(config)` built on the meta device (no weights, no memory);
    None when the model cannot be built there (a missing model directory: the plan notes that elsewhere)."""
    import torch

    try:
        with torch.device("meta"):
            model = model_factory(config)
    except (ValueError, NotImplementedError, OSError, ImportError):
        return None
    return checkpoint_bytes(config, model)
