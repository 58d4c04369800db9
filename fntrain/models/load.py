"""A trained model and its tokenizer on one process, from a `ModelSource` (`fntrain.models.sources`):
the back half of `fntrain generate`.

    assets = load_text_assets(source, spec, config)     # tokenizer / processor: cheap, before the model
    model = load_model(source, spec, config, "cpu")      # eval mode, weights loaded

A checkpoint or a `model.safetensors` export is rebuilt by its recipe: `spec.model_factory(config)` (the
recipe's bare model, built for one process: the run's parallel settings are dropped), with peft's LoRA
adapters applied when the run's `lora` section enables them (as recipes/hf_causal_lm.py's build_model
does, so the checkpoint's adapter weights have somewhere to go), then the full weights are loaded (a
sharded checkpoint through `fntrain.checkpoint.full_state`). A Hugging Face directory loads with
transformers (`AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a config with a vision tower;
a LoRA adapter directory through peft's transformers integration). Nothing downloads.

Tokens: the recipe's assets (`spec.build_assets(config)`: an HF tokenizer, a VLM processor); a tiny GPT
reads UTF-8 bytes (or the tokenizer its token shards were written with). An HF directory reads its own
tokenizer; one without a tokenizer and a vocabulary of at most 257 ids (a tiny GPT exported as GPT-2
before exports carried their byte tokenizer) reads bytes. A byte-level model's EOS is its config's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fntrain.checkpoint.hf_load import set_offline
from fntrain.models.sources import ModelSource

__all__ = ["TextAssets", "load_text_assets", "load_model", "load_weights"]

_BYTE_VOCAB = 257  # 256 bytes and an EOS: the largest vocabulary read as UTF-8 bytes
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class TextAssets:
    """How text becomes tokens: an HF `tokenizer` (None: UTF-8 bytes are the ids), a VLM's
    `processor` (None for a text model), and the id that ends a sample (None: none)."""

    tokenizer: Any = None
    processor: Any = None
    eos_id: int | None = None

    @property
    def takes_images(self) -> bool:
        return self.processor is not None and getattr(self.processor, "image_processor", None) is not None


# ----------------------------------------------------------------------------- tokens


def _shards_assets(config: Any) -> TextAssets:
    """A tiny GPT trained on token shards: the tokenizer they were written with (bytes: none)."""
    from fntrain.data.shard_index import read_index

    index = read_index(config.data.shards)
    if index.tokenizer in (None, "bytes") or not Path(str(index.tokenizer)).is_dir():
        return TextAssets(eos_id=index.eos_id)
    return _tokenizer_assets(Path(str(index.tokenizer)), index.eos_id)


def _tokenizer_assets(directory: Path, eos_id: int | None = None) -> TextAssets:
    set_offline()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return TextAssets(tokenizer, None, eos_id if eos_id is not None else tokenizer.eos_token_id)


def _hf_config(directory: Path) -> dict[str, Any]:
    """config.json's dict ({} for a LoRA adapter directory, which has none)."""
    import json

    file = directory / "config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def _hf_dir_assets(directory: Path) -> TextAssets:
    """The tokenizer (or a VLM's processor) saved in an HF directory; bytes for a byte-level model."""
    config = _hf_config(directory)
    if "vision_config" in config:
        from fntrain.models.vlm import load_processor

        processor = load_processor(directory)
        return TextAssets(processor.tokenizer, processor, processor.tokenizer.eos_token_id)
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    byte_level = isinstance(vocab, int) and vocab <= _BYTE_VOCAB
    eos = config.get("eos_token_id")
    if any((directory / name).is_file() for name in _TOKENIZER_FILES):
        assets = _tokenizer_assets(directory)
        # a byte-level model's EOS is its config's: its tokenizer names byte 0 for lm-eval's sake
        return dataclasses.replace(assets, eos_id=eos if isinstance(eos, int) else None) if byte_level else assets
    if byte_level:
        return TextAssets(eos_id=eos if isinstance(eos, int) else None)
    raise FileNotFoundError(
        f"{str(directory)!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}) and its vocabulary "
        f"({vocab}) is not bytes: save one there with tokenizer.save_pretrained"
    )


def load_text_assets(source: ModelSource, spec: Any = None, config: Any = None) -> TextAssets:
    """The tokens of `source`'s model, read before the model: an HF directory's own tokenizer or
    processor; for a checkpoint or export the recipe's assets (`spec.build_assets(config)`), else the
    shards' tokenizer, else bytes."""
    if source.kind == "hf":
        return _hf_dir_assets(source.path)
    data = getattr(config, "data", None)
    if spec is not None and spec.build_assets is not None:
        assets = spec.build_assets(config)
        if getattr(assets, "image_processor", None) is not None:  # a VLM's processor
            return TextAssets(assets.tokenizer, assets, assets.tokenizer.eos_token_id)
        tokenizer = getattr(assets, "tokenizer", None)
        eos = getattr(assets, "eos_id", None)
        return TextAssets(
            tokenizer, None, eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
        )
    if getattr(data, "shards", None):
        return _shards_assets(config)
    return TextAssets()


# ----------------------------------------------------------------------------- weights


def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str) -> torch.nn.Module:
    """`model` with `state` (its own names) loaded; a `ValueError` naming `where` when a weight is
    missing (one that is tied to a loaded one is not: a checkpoint may hold it under one name) or one
    of `state` is not the model's."""
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    aliases = {name: group for group in names.values() for name in group}
    missing = [key for key in missing if not any(alias in state for alias in aliases.get(key, [key]))]
    if missing or unexpected:
        what = (
            f"lacks {', '.join(missing[:3])}" if missing else f"holds {', '.join(unexpected[:3])}, unknown to"
        )
        raise ValueError(
            f"{where} {what} the model its run config describes"
            f"{' (and more)' if len(missing) > 3 or len(unexpected) > 3 else ''}"
        )
    return model


def _single_process(config: Any) -> Any:
    """`config` with its default parallel settings: the model as one process builds it."""
    parallel = getattr(config, "parallel", None)
    if parallel is None or not dataclasses.is_dataclass(config):
        return config
    return dataclasses.replace(config, parallel=type(parallel)())


def _recipe_model(source: ModelSource, spec: Any, config: Any) -> torch.nn.Module:
    if spec is None or spec.model_factory is None:
        raise ValueError(f"{str(source.path)!r}: its recipe builds no bare model (RecipeSpec.model_factory)")
    model = spec.model_factory(_single_process(config))
    lora = getattr(config, "lora", None)
    if lora is not None and getattr(lora, "enabled", False):
        from fntrain.models.lora import apply_lora

        model = apply_lora(model, lora, seed=getattr(config, "seed", 0))
    if source.kind == "checkpoint":
        from fntrain.checkpoint.full_state import checkpoint_model_state

        state = checkpoint_model_state(source.path)
    else:
        from safetensors.torch import load_file

        state = load_file(str(source.path))
    return load_weights(model, state, repr(str(source.path)))


def _hf_dir_model(directory: Path) -> torch.nn.Module:
    set_offline()
    from fntrain.models.hf import quiet_progress_bars

    if "vision_config" in _hf_config(directory):
        from transformers import AutoModelForImageTextToText as auto_class
    else:
        from transformers import AutoModelForCausalLM as auto_class
    with quiet_progress_bars():
        return auto_class.from_pretrained(str(directory), local_files_only=True)


def load_model(
    source: ModelSource, spec: Any = None, config: Any = None, device: torch.device | str = "cpu"
) -> torch.nn.Module:
    """`source`'s model with its trained weights, on `device`, in eval mode (see the module docstring);
    `spec` and `config` (the recipe's spec and the run's config) for a checkpoint or export."""
    model = _hf_dir_model(source.path) if source.kind == "hf" else _recipe_model(source, spec, config)
    if getattr(getattr(model, "config", None), "use_cache", None) is False:
        model.config.use_cache = True  # a training run switches the KV cache off; sampling wants it
    return model.to(device).eval()
