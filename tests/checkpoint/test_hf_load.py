"""Sharded Hugging Face loading (issue 12, item 2): safetensors read through DCP's HF storage reader into
a meta-built model. Plain models and hand-written safetensors here; (slow tier) a real tiny Llama loaded
by 2 FSDP2 ranks through the hf_causal_lm recipe gives transformers' own logits, each rank reading only
its rows."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fntrain.checkpoint.hf_load import hf_checkpoint_keys, hf_weights, load_hf_weights
from fntrain.runtime.materialize import build_model
from fntrain.runtime.runtime import Runtime
from tests.helpers.waiting import run_to_end
from tests.recipes.test_hf_causal_lm import tiny_hf_model  # noqa: F401 - a fixture of the recipe tests

ROOT = Path(__file__).resolve().parents[2]


class TiedNormLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)
        self.register_buffer("steps", torch.zeros(()))  # persistent, absent from the files


def reference_tied_lm() -> TiedNormLM:
    torch.manual_seed(0)
    model = TiedNormLM()
    with torch.no_grad():
        model.norm.weight.uniform_()
        model.norm.bias.uniform_()
    return model


def write_hf_dir(directory: Path, tensors: dict[str, torch.Tensor], files: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    for index in range(files):
        part = {name: tensors[name].contiguous() for name in names[index::files]}
        save_file(part, str(directory / f"model-{index + 1:05d}-of-{files:05d}.safetensors"))
    return directory


def stored(model: nn.Module) -> dict[str, torch.Tensor]:
    """What save_pretrained writes: the state dict without tied duplicates and non-saved buffers."""
    state = model.state_dict()
    return {name: state[name].clone() for name in ("embed.weight", "norm.weight", "norm.bias")}


def test_meta_build_then_load_gives_the_saved_weights_across_files(tmp_path):
    expected = reference_tied_lm()
    directory = write_hf_dir(tmp_path / "hf", stored(expected), files=2)
    assert set(hf_checkpoint_keys(directory)) == {"embed.weight", "norm.weight", "norm.bias"}
    model = build_model(TiedNormLM, Runtime(), "none", fill=hf_weights(directory))
    for name, tensor in stored(expected).items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.head.weight is model.embed.weight  # the tie survives and is loaded through embed
    assert torch.equal(model.freqs, torch.arange(4.0))  # constructed buffers keep their values
    assert torch.equal(model.steps, torch.zeros(()))


def test_a_bf16_checkpoint_loads_into_fp32_weights(tmp_path):
    tensors = {name: t.to(torch.bfloat16) for name, t in stored(reference_tied_lm()).items()}
    model = build_model(TiedNormLM, Runtime(), "none", fill=hf_weights(write_hf_dir(tmp_path / "hf", tensors)))
    assert model.embed.weight.dtype == torch.float32
    assert torch.equal(model.embed.weight, tensors["embed.weight"].float())


def test_missing_parameters_are_named(tmp_path):
    tensors = stored(reference_tied_lm())
    del tensors["norm.bias"]
    with pytest.raises(KeyError, match=r"lacks parameters: norm\.bias"):
        load_hf_weights(TiedNormLM(), write_hf_dir(tmp_path / "hf", tensors))


def test_a_shape_mismatch_is_named(tmp_path):
    tensors = stored(reference_tied_lm())
    tensors["norm.weight"] = torch.ones(5)
    with pytest.raises(ValueError, match=r"norm\.weight: .* shape \(5,\), the model \(4,\)"):
        load_hf_weights(TiedNormLM(), write_hf_dir(tmp_path / "hf", tensors))


def test_unexpected_tensors_are_reported_and_no_files_is_an_error(tmp_path, caplog):
    tensors = {**stored(reference_tied_lm()), "extra.weight": torch.ones(2)}
    load_hf_weights(TiedNormLM(), write_hf_dir(tmp_path / "hf", tensors))
    assert "extra.weight" in caplog.text
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_weights(TiedNormLM(), tmp_path / "empty")


# ----------------------------------------------------------------------------- slow: transformers, 2 ranks


@pytest.fixture(scope="module")
def sharded_tied_llama(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings, saved by save_pretrained in several safetensors files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so a norm left unloaded would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    directory = tmp_path_factory.mktemp("llama") / "model"
    model.save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    return directory


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_rank_fsdp2_load_gives_transformers_logits_and_reads_only_local_rows(sharded_tied_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.checkpoint.hf_load_worker import INPUT_IDS

    out = tmp_path / "result.pt"
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tests.checkpoint.hf_load_worker", str(sharded_tied_llama), str(out),
    ]  # fmt: skip
    result = run_to_end(command, "the 2-rank FSDP2 load of the sharded Llama (torchrun)", 170, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    loaded = torch.load(out)

    reference_model = AutoModelForCausalLM.from_pretrained(sharded_tied_llama, local_files_only=True).eval()
    with torch.no_grad():
        expected = reference_model(input_ids=INPUT_IDS).logits
    torch.testing.assert_close(loaded["logits"], expected, rtol=1e-5, atol=1e-5)
    assert loaded["tied"] and loaded["dtype"] == "torch.float32"
    assert loaded["local_numel"] * 2 == loaded["global_numel"]

    # Each rank asked the files for its own rows only; together they read every stored element once.
    stored_numel = {name: shape.numel() for name, (shape, _) in hf_checkpoint_keys(sharded_tied_llama).items()}
    per_rank = [sum(torch.Size(lengths).numel() for _, _, lengths in reads) for reads in loaded["reads"]]
    assert sum(per_rank) == sum(stored_numel.values())
    assert all(count < sum(stored_numel.values()) for count in per_rank)
    embed_rows = {rank: [o[0] for name, o, _ in reads if name == "model.embed_tokens.weight"]
                  for rank, reads in enumerate(loaded["reads"])}  # fmt: skip
    assert embed_rows == {0: [0], 1: [160]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recipe_meta_init_trains_exactly_like_the_transformers_load(tiny_hf_model, tmp_path, monkeypatch):  # noqa: F811
    import dataclasses
    import json

    import fntrain.models.hf as hf_models
    from fntrain.run.job import run_job
    from fntrain.runtime.parallel import ParallelConfig
    from recipes import hf_causal_lm as hf
    from tests.recipes.test_hf_causal_lm import hf_run_config

    model_dir, data_path = tiny_hf_model
    losses = {}
    for meta_init in (False, True):
        run_dir = tmp_path / f"meta_{meta_init}"
        config = dataclasses.replace(
            hf_run_config(model_dir, data_path, run_dir), parallel=ParallelConfig(meta_init=meta_init)
        )
        if meta_init:  # the meta path never loads through from_pretrained
            monkeypatch.setattr(
                hf_models, "load_pretrained", lambda *a, **k: pytest.fail("meta_init used load_pretrained")
            )
        assert run_job(config, hf.spec).state.global_step == 3
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[meta_init] = [r["loss"] for r in records if "loss" in r]
    assert len(losses[True]) == 3 and losses[True] == losses[False]
