"""The tiny GPT (`fntrain.models.gpt.TinyGPT`) saved as a Hugging Face GPT-2.

    export_gpt2(model, "runs/tiny/hf_model", config)     # model.safetensors + config.json
    AutoModelForCausalLM.from_pretrained("runs/tiny/hf_model")   # a GPT2LMHeadModel, the same logits

The tiny GPT is architecturally GPT-2: learned token and position embeddings, pre-norm LayerNorm blocks
(eps 1e-5), query/key/value projections (fused into GPT-2's c_attn on export), a 4x GELU MLP, a final LayerNorm and an output head tied to the
token embedding. Its `nn.GELU()` is the exact (erf) GELU, so the config names `"gelu"`, not GPT-2's
tanh approximation `"gelu_new"`. GPT-2 stores its projections as `Conv1D` weights [in, out], the
transpose of `nn.Linear`'s [out, in]; the tied head is not stored (GPT-2 ties it on load). Writing needs
neither transformers nor peft: config.json is written here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["gpt2_config", "gpt2_state_dict", "gpt2_conversion", "export_gpt2"]

# fntrain name pattern -> (GPT-2 name, transpose)
_RENAMES: tuple[tuple[str, str, bool], ...] = (
    (r"tok\.weight", "transformer.wte.weight", False),
    (r"pos\.weight", "transformer.wpe.weight", False),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"blocks\.(\d+)\.ln1\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"blocks\.(\d+)\.ln2\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"transformer.h.\1.attn.c_proj.\2", True),
    (r"blocks\.(\d+)\.mlp\.0\.(weight|bias)", r"transformer.h.\1.mlp.c_fc.\2", True),
    (r"blocks\.(\d+)\.mlp\.2\.(weight|bias)", r"transformer.h.\1.mlp.c_proj.\2", True),
)
_TIED_HEAD = "head.weight"
# Separate q, k, v projections (so tensor parallelism can split them by head) are one c_attn in GPT-2.
_QKV = re.compile(r"blocks\.(\d+)\.attn\.([qkv])\.(weight|bias)")


def gpt2_config(config: Any, *, eos_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """The GPT2Config (as config.json's dict) of a tiny GPT shaped by `config` (context, n_layer,
    n_head, d_model, dropout, vocab_size: `fntrain.models.gpt.ModelConfig`). `eos_id` becomes the
    BOS and EOS id (None: the model has none)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context,
        "n_embd": config.d_model,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.d_model,
        "activation_function": "gelu",  # nn.GELU(): exact erf, not GPT-2's tanh "gelu_new"
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": dtype,
        "use_cache": True,
    }


def gpt2_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny GPT's full state dict renamed (and projections transposed) to GPT2LMHeadModel's; the
    tied head is dropped. A key it does not know is a ValueError naming it."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        if key == _TIED_HEAD:
            continue
        if match := _QKV.fullmatch(key):
            layer, which, kind = match.groups()
            qkv.setdefault(f"transformer.h.{layer}.attn.c_attn.{kind}", {})[which] = tensor.detach().cpu()
            continue
        for pattern, name, transpose in _RENAMES:
            if re.fullmatch(pattern, key):
                tensor = tensor.detach().cpu()
                out[re.sub(pattern, name, key)] = (
                    tensor.t() if transpose and tensor.ndim == 2 else tensor
                ).contiguous()
                break
        else:
            raise ValueError(f"export_gpt2: {key!r} is not a tiny GPT weight with a GPT-2 counterpart")
    for name, parts in qkv.items():
        if sorted(parts) != ["k", "q", "v"]:
            raise ValueError(f"export_gpt2: {name} needs q, k and v, got only {sorted(parts)}")
        fused = torch.cat([parts["q"], parts["k"], parts["v"]])
        out[name] = (fused.t() if fused.ndim == 2 else fused).contiguous()
    return out


def gpt2_conversion(
    state: Mapping[str, torch.Tensor], config: Any, *, eos_id: int | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(GPT2Config as config.json's dict, GPT2LMHeadModel's tensors) of a tiny GPT's full state dict:
    what `export_gpt2` writes and `fntrain export --format hf` writes for a tiny GPT checkpoint."""
    tensors = gpt2_state_dict(state)
    dtype = str(tensors["transformer.wte.weight"].dtype).removeprefix("torch.")
    return gpt2_config(config, eos_id=eos_id, dtype=dtype), tensors


def export_gpt2(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    config: Any,
    *,
    eos_id: int | None = None,
    pipeline_group: Any = None,
) -> Path:
    """Write `model` (a tiny GPT, possibly under DDP/FSDP2/tensor or pipeline parallelism) to `out_dir`
    as a Hugging Face GPT-2: model.safetensors and config.json (modes 0666 less the umask). Under a
    process group every rank must call it (the full weights are gathered, from every pipeline stage of
    `pipeline_group`); rank 0 writes, beside `out_dir`, renamed in once complete (a failure leaves the
    previous export or none: `export_converted`). Returns `out_dir`."""
    from fntrain.checkpoint.export import export_converted

    def convert(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return gpt2_conversion(state, config, eos_id=eos_id)

    return export_converted(model, out_dir, convert, pipeline_group=pipeline_group)
