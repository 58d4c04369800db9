"""Model-family glue: Hugging Face loading and saving (`fntrain.models.hf`), LoRA through peft
(`fntrain.models.lora`), the tiny GPT (`fntrain.models.gpt`) and its export as a Hugging Face GPT-2
(`fntrain.models.gpt2`), image-text-to-text models and the tiny built-in LLaVA (`fntrain.models.vlm`).

transformers and peft (the `hf` and `lora` extras) are imported only when a function needs them, so
importing this package costs nothing without them.
"""

from fntrain.models.gpt2 import export_gpt2
from fntrain.models.hf import ModelAssets, check_vocab, load_assets, load_causal_lm, save_hf_model, unwrap
from fntrain.models.hf_config import AssetsConfig, HFModelConfig
from fntrain.models.lora import LoraConfig, apply_lora, save_adapter_or_merged
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
    "LoraConfig",
    "apply_lora",
    "save_adapter_or_merged",
    "export_gpt2",
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
