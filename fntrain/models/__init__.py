"""Model-family glue: Hugging Face loading and saving (`fntrain.models.hf`).

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
]
