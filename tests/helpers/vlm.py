"""Shared by the VLM tests: a tiny LLaVA (smaller than the built-in default) built once per session
into a temporary cache, and its processor."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fntrain.data.shapes import shapes_texts
from fntrain.models.vlm import TinyLlavaConfig, VLMModelConfig, load_processor, resolve_model_dir

TINY = TinyLlavaConfig(image_size=16, patch_size=4, vision_width=16, vision_layers=1, text_width=16,
                       text_layers=1, heads=2)  # fmt: skip


@cache
def tiny_model_dir(cache_dir: str) -> Path:
    """The test-sized tiny LLaVA under `cache_dir` (built on first use)."""
    return resolve_model_dir(VLMModelConfig(cache_dir=cache_dir), shapes_texts(), TINY)


@cache
def tiny_processor(cache_dir: str):
    return load_processor(tiny_model_dir(cache_dir))
