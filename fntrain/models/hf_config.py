"""What a Hugging Face causal-LM run is given, and what can be checked from it without loading a model.

    model_config.validate("model"); assets_config.validate("assets")    # in a recipe's validate
    check_packed_attention(model_config, packing); check_tensor_parallel(model_config, tp_size)

`HFModelConfig` and `AssetsConfig` name local directories only (a Hub id is never looked up): the
`require_*` functions check a directory and raise a `ConfigError` naming the field (`require_model_kind`:
the model is of the kind a recipe trains, by transformers' auto-class tables). The checks here read
config.json at most; loading, tokenizers and saving are `fntrain.models.hf`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from fntrain.config import ConfigError, absent_input, require_choice, require_str

__all__ = [
    "DTYPES",
    "ATTN_IMPLEMENTATIONS",
    "SAFE_INDEX",
    "require_local_dir",
    "require_model_config_dir",
    "require_model_dir",
    "require_model_kind",
    "read_chat_template",
    "HFModelConfig",
    "AssetsConfig",
    "model_vocab_size",
    "check_packed_attention",
    "check_tensor_parallel",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
SAFE_INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- local directories


def require_local_dir(field_name: str, path: str, *, needs: Sequence[str] = ()) -> Path:
    """`path` as an existing local directory holding `needs`, else a `ConfigError` naming the field
    (a Hub id is never looked up)."""
    directory = Path(path).expanduser()
    if directory.is_file():
        raise ConfigError(f"{field_name} {path!r} is a file, not a directory")
    if not directory.is_dir():
        raise ConfigError(
            f"{field_name} {path!r} is not a local directory; fntrain never downloads models: "
            "save one with save_pretrained (or huggingface-cli download) and pass its path"
        )
    missing = [name for name in needs if not (directory / name).exists()]
    if missing:
        raise ConfigError(f"{field_name} {path!r} lacks {', '.join(missing)}")
    return directory


def require_model_config_dir(field_name: str, path: str) -> Path:
    """A local directory holding a config.json with a JSON object (what building the model on the meta
    device, and so `fntrain plan`, needs); else a `ConfigError` naming the field and the directory."""
    directory = require_local_dir(field_name, path, needs=("config.json",))
    try:
        saved = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # ValueError: not JSON, or not UTF-8
        raise ConfigError(f"{field_name} {path!r}: config.json is not a JSON file ({error})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{field_name} {path!r}: config.json must hold a JSON object")
    return directory


def require_model_dir(field_name: str, path: str) -> Path:
    """A local model directory: a config.json holding a JSON object and safetensors weights (one file,
    shards, or an index); else a `ConfigError` naming the field and the directory. Missing weights pass
    inside `fntrain.config.inputs_optional()` (a plan reads none)."""
    directory = require_model_config_dir(field_name, path)
    if not any(directory.glob("*.safetensors")) and not (directory / SAFE_INDEX).exists():
        message = f"{field_name} {path!r} holds no *.safetensors weights"
        if not absent_input(message, note=False):  # a plan reads no weights: nothing to say
            raise ConfigError(message)
    return directory


# Each kind: (what a model of it is, what it is not, the recipe that trains it, what that recipe needs).
_KINDS = {
    "causal_lm": ("a text-only causal LM", "not a causal LM", "hf_causal_lm", "a causal LM with its "
                  "language-model head (a *ForCausalLM, as AutoModelForCausalLM.save_pretrained writes)"),
    "vlm": ("a vision-language model", "not a vision-language model", "vlm",
            "a vision-language model (LLaVA-style, with a processor)"),
}  # fmt: skip


def require_model_kind(field_name: str, path: str, kind: str) -> None:
    """A `ConfigError` naming the field when the config.json in `path` describes a model of another kind
    than `kind` ("causal_lm": one AutoModelForCausalLM builds; "vlm": one AutoModelForImageTextToText
    builds), judged by transformers' own auto-class tables from its `architectures` and `model_type`.
    A model_type transformers does not know, or transformers not installed, passes: the loader (or
    the package check) says what is wrong."""
    try:
        saved = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
        from transformers.models.auto import configuration_auto, modeling_auto
    except (ImportError, OSError, ValueError):
        return
    if not isinstance(saved, dict) or saved.get("model_type") not in configuration_auto.CONFIG_MAPPING_NAMES:
        return
    fits = {
        "causal_lm": _is_kind(saved, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "vlm": _is_kind(saved, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) or "vision_config" in saved,
    }
    if fits[kind]:
        return
    names = ", ".join(map(str, saved.get("architectures") or [f"model_type {saved['model_type']!r}"]))
    other = next((name for name, fit in fits.items() if fit), None)
    is_what = _KINDS[other][0] if other else _KINDS[kind][1]
    _, _, recipe, needs = _KINDS[kind]
    instead = f"; the {_KINDS[other][2]} recipe takes it" if other else ""
    raise ConfigError(f"{field_name} {path!r} is {is_what} ({names}): the {recipe} recipe needs {needs}{instead}")


def _is_kind(saved: Mapping, table: Mapping[str, str]) -> bool:
    """Whether the saved config's architectures (or, when it names none, its model_type) are in one of
    transformers' auto-class tables (model_type -> class name)."""
    architectures = saved.get("architectures")
    if architectures:
        return any(name in set(table.values()) for name in architectures)
    return saved.get("model_type") in table


def read_chat_template(value: str, field_name: str = "assets.chat_template") -> str:
    """The template text: `value` itself when it looks like Jinja, else the file it names."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ConfigError(f"{field_name} {value!r} is neither a file nor a Jinja template")


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class HFModelConfig:
    """The model to fine-tune: a local directory, never a Hub id."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path",)

    path: str = ""
    """Local model directory (config.json + *.safetensors, as save_pretrained writes it). Required."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Dtype of the loaded weights (auto: the checkpoint's). For bf16 compute over fp32 weights use parallel.mixed_precision instead."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel transformers uses."""

    def validate(self, prefix: str = "model") -> None:
        """Value rules naming `prefix.field`; the directory must hold config.json and safetensors."""
        require_str(f"{prefix}.path", self.path)
        if not self.path:
            raise ValueError(
                f"{prefix}.path is required: a local model directory (config.json + safetensors)"
            )
        require_choice(f"{prefix}.dtype", self.dtype, (*DTYPES, "auto"))
        require_choice(f"{prefix}.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        require_model_dir(f"{prefix}.path", self.path)
        require_model_kind(f"{prefix}.path", self.path, "causal_lm")


@dataclass(frozen=True)
class AssetsConfig:
    """Model assets: the tokenizer and its chat template."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("tokenizer_path", "chat_template")

    tokenizer_path: str | None = None
    """Local tokenizer directory (None: model.path)."""
    chat_template: str | None = None
    """Jinja chat template for chat data: a file path or the template text (None: the tokenizer's own). It is saved with the tokenizer in output_dir."""

    def validate(self, prefix: str = "assets") -> None:
        """Value rules naming `prefix.field`; a given tokenizer directory and template file must exist."""
        require_str(f"{prefix}.tokenizer_path", self.tokenizer_path, optional=True)
        require_str(f"{prefix}.chat_template", self.chat_template, optional=True)
        if self.tokenizer_path is not None:
            require_local_dir(f"{prefix}.tokenizer_path", self.tokenizer_path)
        if self.chat_template is not None:
            read_chat_template(self.chat_template, f"{prefix}.chat_template")


# ----------------------------------------------------------------------------- checks from config.json alone


def model_vocab_size(config: HFModelConfig) -> int | None:
    """The model's vocabulary size from its config.json (None when it names none), read without loading
    the model."""
    vocab = json.loads((Path(config.path).expanduser() / "config.json").read_text()).get("vocab_size")
    return vocab if isinstance(vocab, int) else None


def model_max_positions(config: HFModelConfig) -> int | None:
    """The positions the model attends over, from its config.json (`max_position_embeddings` or
    `n_positions`, a multimodal config's text config first); None when it names none."""
    saved = json.loads((Path(config.path).expanduser() / "config.json").read_text())
    text = saved.get("text_config") or saved
    for name in ("max_position_embeddings", "n_positions"):
        value = text.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_packed_attention(config: HFModelConfig, packing: bool, prefix: str = "model") -> None:
    """A ValueError when packed data (`fntrain.data.sft`: a 4-D boolean block-diagonal mask) meets an
    attention kernel that would misread it: transformers hands a 4-D mask to the kernel as it is, and
    only sdpa reads a boolean one (eager adds it to the scores as 0/1, silently letting examples see
    each other; flash_attention_2 takes no such mask). Call it from a recipe's validate."""
    if packing and config.attn_implementation != "sdpa":
        raise ValueError(
            f"{prefix}.attn_implementation {config.attn_implementation!r} cannot take packed data's 4-D "
            "boolean attention mask: use 'sdpa' or turn data.packing off"
        )


def check_tensor_parallel(config: HFModelConfig, tp_size: int) -> None:
    """A ValueError when `tp_size` does not divide the attention heads or the key/value heads in the
    model's config.json (read without loading the model): each rank holds whole heads. Call it from a
    recipe's validate; `fntrain.models.hf_tp` checks the loaded model again."""
    if tp_size == 1:
        return
    saved = json.loads((Path(config.path).expanduser() / "config.json").read_text())
    text = saved.get("text_config") or saved  # multimodal configs nest the language model's
    heads = text.get("num_attention_heads")
    for name, count in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", text.get("num_key_value_heads") or heads),
    ):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(
                f"parallel.tp_size ({tp_size}) must divide the model's {name} ({count}): each rank holds whole heads"
            )
