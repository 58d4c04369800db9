"""The tiny GPT saved as a Hugging Face GPT-2 (`fntrain.models.gpt2`): the name mapping (fast), and
(slow tier: transformers) `AutoModelForCausalLM` loads it as a GPT2LMHeadModel with the same logits, and
the recipe's run writes it to <run_dir>/hf_model with the usual file modes."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.models.gpt2 import export_gpt2, gpt2_config, gpt2_state_dict

SHAPE = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32, vocab_size=257)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_every_weight_maps_and_projections_are_transposed():
    torch.manual_seed(0)
    model = TinyGPT(SHAPE)
    mapped = gpt2_state_dict(model.state_dict())
    assert "lm_head.weight" not in mapped and len(mapped) == 4 + 12 * SHAPE.n_layer
    assert torch.equal(mapped["transformer.wte.weight"], model.tok.weight)
    attn = model.blocks[1].attn
    qkv = torch.cat([attn.q.weight, attn.k.weight, attn.v.weight])
    assert mapped["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)
    assert torch.equal(mapped["transformer.h.1.attn.c_attn.weight"], qkv.t())
    assert torch.equal(mapped["transformer.h.0.mlp.c_fc.weight"], model.blocks[0].mlp[0].weight.t())
    with pytest.raises(ValueError, match="'extra.weight' is not a tiny GPT weight"):
        gpt2_state_dict({"extra.weight": torch.zeros(1)})
    config = gpt2_config(SHAPE, eos_id=256)
    assert config["activation_function"] == "gelu" and config["n_positions"] == 16
    assert config["vocab_size"] == 257 and config["eos_token_id"] == 256 and config["tie_word_embeddings"]


def test_export_writes_safetensors_and_config_with_usual_modes(tmp_path):
    model = TinyGPT(SHAPE)
    out = export_gpt2(model, tmp_path / "hf_model", SHAPE)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask(), path
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.slow
def test_transformers_loads_it_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    torch.manual_seed(0)
    model = TinyGPT(SHAPE).eval()
    with torch.no_grad():  # trained-looking weights: non-zero biases and non-unit norms
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln" in name or "ln_f" in name:
                param.add_(torch.randn_like(param) * 0.1)
    out = export_gpt2(model, tmp_path / "hf_model", SHAPE, eos_id=256)
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert isinstance(loaded, GPT2LMHeadModel)
    ids = torch.randint(0, SHAPE.vocab_size, (3, SHAPE.context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(ids), atol=1e-5, rtol=0)
        short = ids[:, :5]  # a shorter sequence: positions and the causal mask agree too
        torch.testing.assert_close(loaded(input_ids=short).logits, model(short), atol=1e-5, rtol=0)
    generated = loaded.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
