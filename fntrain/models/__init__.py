"""Model-family glue: Hugging Face loading and saving (`fntrain.models.hf`), image-text-to-text models
and the tiny built-in LLaVA (`fntrain.models.vlm`).

transformers (the `hf` extra) is imported only when a function needs it, so importing this package
costs nothing without it.
"""

from fntrain.models.hf import (
    AssetsConfig,
    HFModelConfig,
    ModelAssets,
    check_vocab,
    hf_flops_per_token,
    load_assets,
    load_causal_lm,
    save_hf_model,
    unwrap,
)
from fntrain.models.vlm import (
    TinyLlavaConfig,
    VLMModelConfig,
    answer_accuracy,
    build_tiny_llava,
    load_processor,
    load_vlm,
    resolve_model_dir,
    save_vlm,
    vlm_forward,
)

__all__ = [
    "HFModelConfig",
    "AssetsConfig",
    "ModelAssets",
    "load_assets",
    "load_causal_lm",
    "check_vocab",
    "unwrap",
    "save_hf_model",
    "hf_flops_per_token",
    "VLMModelConfig",
    "TinyLlavaConfig",
    "build_tiny_llava",
    "resolve_model_dir",
    "load_processor",
    "load_vlm",
    "save_vlm",
    "vlm_forward",
    "answer_accuracy",
]
