"""Sampling from causal language models: how tokens are drawn (settings, pick), one random stream per row
(keys), and the batched decode loop over a model's KV cache (decode). Below step/ so that a rollout inside
a step can sample; it imports torch and fntrain.config only and duck-types the models it decodes."""

from fntrain.sampling.decode import Decoded, decode, model_context, sample_tokens
from fntrain.sampling.keys import row_generator, row_seed
from fntrain.sampling.pick import cut_scores, draw_uniforms, pick_tokens
from fntrain.sampling.settings import TEXT_DEFAULTS, SampleSettings, eos_ids

__all__ = [
    "Decoded", "SampleSettings", "TEXT_DEFAULTS", "cut_scores", "decode", "draw_uniforms", "eos_ids", "model_context",
    "pick_tokens", "row_generator", "row_seed", "sample_tokens",
]  # fmt: skip
