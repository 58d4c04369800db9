"""LoRA with real peft on a tiny Llama built from its config, in one process: `apply_lora` freezes the
base and trains only the adapter, its seeded initialisation repeats whatever the global RNG did and
leaves that RNG alone; `save_adapter_or_merged` writes the adapter (PEFT layout) or the merged model
(save_pretrained layout, under a 1-rank gloo group too: the gathered state dict), each loading back
with the trained model's logits, and with LoRA off the whole model. Training through the recipe and
resuming: tests/models/test_lora.py (slow tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fntrain.models.lora import LoraConfig, apply_lora, save_adapter_or_merged, trainable_parameters
from fntrain.runtime import Runtime

pytest.importorskip("peft")
pytest.importorskip("transformers")

LORA = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
IDS = torch.tensor([[1, 5, 9, 30, 2, 17]])


class Tokenizer:
    """Stands in for the run's tokenizer: `save_pretrained` writes one file, as a tokenizer would."""

    def save_pretrained(self, directory: str) -> None:
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))


class StubAssets:
    tokenizer = Tokenizer()


def one_layer_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def trained(seed: int = 0) -> torch.nn.Module:
    """A peft-wrapped tiny Llama whose adapters are nonzero (as after training), so they change logits."""
    model = apply_lora(one_layer_llama(), LORA, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param))
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_off_leaves_the_model_as_it_is():
    model = one_layer_llama()
    assert apply_lora(model, LoraConfig()) is model
    assert trainable_parameters(model) == (sum(p.numel() for p in model.parameters()),) * 2


def test_only_the_seeded_adapter_trains_and_the_global_rng_is_untouched():
    base = one_layer_llama()
    want = logits(base)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    first = apply_lora(base, LORA, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    trainable = {name for name, p in first.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    count, total = trainable_parameters(first)
    assert count == sum(first.get_parameter(n).numel() for n in trainable) and 0 < count < total
    torch.testing.assert_close(logits(first), want)  # lora_B starts at zero: the base's outputs

    torch.rand(9)  # the global RNG moves on; the seeded adapters do not
    second = apply_lora(one_layer_llama(), LORA, seed=7)
    third = apply_lora(one_layer_llama(), LORA, seed=8)
    adapters = [{n: p for n, p in m.named_parameters() if "lora_A" in n} for m in (first, second, third)]
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])
    assert not all(torch.equal(adapters[0][n], adapters[2][n]) for n in adapters[0])


def test_the_adapter_export_loads_with_peft(tmp_path):
    from peft import PeftModel

    model = trained()
    out = save_adapter_or_merged(model, LORA, tmp_path / "adapter", Runtime(), StubAssets())
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"]
    assert sorted(json.loads((out / "adapter_config.json").read_text())["target_modules"]) == [
        "q_proj",
        "v_proj",
    ]
    loaded = PeftModel.from_pretrained(one_layer_llama(), out, local_files_only=True).eval()
    torch.testing.assert_close(logits(loaded), logits(model))


@pytest.mark.parametrize("distributed", [False, True])
def test_the_merged_export_loads_as_a_plain_model(tmp_path, distributed):
    from transformers import AutoModelForCausalLM

    model = trained()
    want = logits(model)
    merge = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"), merge_on_export=True)
    if distributed:  # a 1-rank group: the full state dict is gathered first
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        out = save_adapter_or_merged(
            model, merge, tmp_path / "merged", Runtime(backend="gloo" if distributed else None)
        )
    finally:
        if distributed:
            dist.destroy_process_group()
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied again after the merge
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    torch.testing.assert_close(logits(loaded), want, atol=1e-5, rtol=1e-5)
    # The trained model is untouched: its adapters are still there and its base weights unmerged.
    assert any("lora" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(logits(model), want, atol=0, rtol=0)


def test_lora_off_saves_the_whole_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = one_layer_llama()
    out = save_adapter_or_merged(model, LoraConfig(), tmp_path / "full", Runtime(), StubAssets())
    assert (out / "tokenizer_config.json").is_file()
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(out, local_files_only=True)), logits(model)
    )
