"""Tensor parallelism for Hugging Face causal LMs (`fntrain.models.hf_tp`): the declared plan and its
translation into torch ParallelStyles, and the refusals (no plan, unsupported styles, LoRA, head counts
tp does not divide), all in one process; (slow tier) 2 gloo ranks under torchrun split tiny Llama /
Qwen2 / Qwen3 / Phi3 models and match the unsharded model's logits, summed loss and gradients."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from fntrain.models.hf_tp import (
    check_tp_divisible,
    declared_tp_plan,
    hf_tensor_parallel,
    resolve_tp_plan,
    tp_styles,
)
from tests.helpers.fork_server import HF_PRELOAD, started
from tests.helpers.waiting import run_to_end
from tests.helpers.workers import worker_env

ROOT = Path(__file__).resolve().parents[2]
LAYER_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def llama_config(**overrides):
    from transformers import LlamaConfig

    sizes = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaConfig(**{**sizes, **overrides})


@pytest.fixture(scope="module")
def tp_llama():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def fake_mesh(size: int):
    """Enough of a DeviceMesh for the checks that run before any splitting."""
    return SimpleNamespace(size=lambda: size)


def test_llama_plan_is_its_declared_one_with_the_embeddings(tp_llama):
    plan = declared_tp_plan(tp_llama)
    assert plan == {
        "lm_head": "colwise_gather_output",
        "model.embed_tokens": "embedding_rowwise",
        **{f"model.layers.*.{name}": style for name, style in LAYER_PLAN.items()},
    }


def test_plan_without_merged_tp_plan_comes_from_config_and_class(tp_llama, monkeypatch):
    # transformers before 5 has no merged `model.tp_plan`: the config's base plan, under the base
    # model's prefix, and the class's `_tp_plan` give the same plan.
    monkeypatch.setattr(tp_llama, "_tp_plan", None)
    assert set(declared_tp_plan(tp_llama).items()) == {
        ("lm_head", "colwise_gather_output"),
        ("model.embed_tokens", "embedding_rowwise"),
        *((f"model.layers.*.{name}", style) for name, style in LAYER_PLAN.items()),
    }


def test_plan_patterns_expand_to_every_layer(tp_llama):
    resolved = resolve_tp_plan(tp_llama, declared_tp_plan(tp_llama))
    expected = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise"}
    for layer in range(2):
        expected |= {f"model.layers.{layer}.{name}": style for name, style in LAYER_PLAN.items()}
    assert resolved == expected


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_styles_translate_to_torch_parallel_styles(tp_llama, loss_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = tp_styles(tp_llama, loss_parallel)
    q_proj, o_proj = styles["model.layers.0.self_attn.q_proj"], styles["model.layers.1.mlp.down_proj"]
    assert (
        type(q_proj) is ColwiseParallel and q_proj.output_layouts == (Shard(-1),) and q_proj.use_local_output
    )
    assert type(o_proj) is RowwiseParallel and o_proj.output_layouts == (Replicate(),)
    embeddings = styles["model.embed_tokens"]
    assert type(embeddings) is RowwiseParallel and embeddings.input_layouts == (Replicate(),)
    lm_head = styles["lm_head"]
    assert type(lm_head) is ColwiseParallel
    if loss_parallel:  # vocab-sharded DTensor logits for loss_parallel()
        assert lm_head.output_layouts == (Shard(-1),) and not lm_head.use_local_output
    else:  # full logits, a plain tensor
        assert lm_head.output_layouts == (Replicate(),) and lm_head.use_local_output


def test_per_head_norms_become_replicated_weights():
    # Qwen3's q_norm / k_norm act on each head: replicated weights whose gradients DTensor sums.
    from torch.distributed.tensor.parallel import SequenceParallel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**llama_config().to_dict(), "model_type": "qwen3", "head_dim": 16})
    styles = tp_styles(Qwen3ForCausalLM(config), loss_parallel=True)
    norm = styles["model.layers.1.self_attn.k_norm"]
    assert type(norm) is SequenceParallel and norm.use_local_output


@pytest.mark.parametrize(
    ("overrides", "tp_size", "words"),
    [
        ({}, 4, r"--parallel.tp-size 4 must divide the model's num_key_value_heads \(2\)"),
        (
            {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6},
            4,
            r"num_attention_heads \(6\)",
        ),
        ({"num_attention_heads": 4, "num_key_value_heads": 4}, 3, r"--parallel.tp-size 3"),
    ],
)
def test_head_counts_tp_does_not_divide_are_refused(overrides, tp_size, words):
    model = SimpleNamespace(config=llama_config(**overrides))
    with pytest.raises(ValueError, match=words):
        check_tp_divisible(model, tp_size)
    with pytest.raises(ValueError, match="model type 'llama'"):
        hf_tensor_parallel(model, fake_mesh(tp_size), loss_parallel=True)


def test_head_counts_tp_divides_pass():
    check_tp_divisible(SimpleNamespace(config=llama_config()), 2)


def test_a_model_without_a_plan_is_refused():
    class Toy(nn.Module):
        config = SimpleNamespace(model_type="toy", num_attention_heads=4, num_key_value_heads=4)

    with pytest.raises(ValueError, match=r"model type 'toy' declares no tensor-parallel plan.*tp-size 1"):
        hf_tensor_parallel(Toy(), fake_mesh(2), loss_parallel=False)


def test_an_output_head_plan_alone_is_refused(tp_llama, monkeypatch):
    monkeypatch.setattr(tp_llama.config, "base_model_tp_plan", None)  # the class still names lm_head
    with pytest.raises(ValueError, match="model type 'llama' declares no tensor-parallel plan"):
        declared_tp_plan(tp_llama)


def test_gpt2_declares_no_plan():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    with pytest.raises(ValueError, match="model type 'gpt2' declares no tensor-parallel plan"):
        tp_styles(model, loss_parallel=True)


def test_unsupported_styles_are_named(tp_llama, monkeypatch):
    plan = {**tp_llama.tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise", "model.norm": "local"}
    monkeypatch.setattr(tp_llama, "_tp_plan", plan)
    with pytest.raises(ValueError, match=r"model type 'llama' .* does not support: local, packed_colwise"):
        tp_styles(tp_llama, loss_parallel=True)


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"model.blocks.*.attn": "colwise"}, r"names 'model.blocks.\*.attn', which matches no module"),
        ({"model.norm": "colwise"}, r"splits nn.Linear and nn.Embedding only, but model.norm \(colwise\)"),
        ({"model.norm": "replicated_with_grad_allreduce"}, r"model.norm \(replicated_with_grad_allreduce\)"),
    ],
)
def test_plans_that_do_not_fit_the_modules_are_refused(tp_llama, entry, words):
    with pytest.raises(ValueError, match=words):
        resolve_tp_plan(tp_llama, {**declared_tp_plan(tp_llama), **entry})


def test_lora_adapters_are_refused(tp_llama):
    pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    from fntrain.models.lora import LoraConfig, apply_lora

    adapted = apply_lora(LlamaForCausalLM(llama_config()), LoraConfig(rank=2, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match=r"carries LoRA/PEFT adapters .*--parallel.tp-size 1"):
        hf_tensor_parallel(adapted, fake_mesh(2), loss_parallel=True)


# ----------------------------------------------------------------------------- 2 ranks (slow)


# What the workers import, once: torchrun's agent and both workers fork from a process that imported
# torch and transformers (tests/helpers/fork_server.py), instead of each importing them (most of this test's cost).
PRELOAD = (*HF_PRELOAD, "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.phi3.modeling_phi3", "fntrain.models.hf_tp", "tests.models.hf_tp_worker")  # fmt: skip


@pytest.mark.slow
def test_two_rank_split_matches_the_unsharded_model(tmp_path):
    """Logits, the summed cross-entropy (under loss_parallel() when the logits are vocab-sharded) and
    every gradient (full_tensor()) match the unsharded model, with loss_parallel on and off."""
    out = tmp_path / "results.json"
    command = [
        "torchrun", "--standalone", "--nproc_per_node=2",
        "-m", "tests.models.hf_tp_worker", str(tmp_path / "models"), str(out),
    ]  # fmt: skip
    with started(worker_env(HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error"), PRELOAD) as env:
        result = run_to_end(command, "the 2-rank tensor-parallel worker (torchrun)", 300, cwd=ROOT, env=env)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    results = json.loads(out.read_text())
    from tests.models.hf_tp_worker import MODELS

    assert set(results) == {f"{name}/loss_parallel={on}" for name in MODELS for on in (True, False)}
    for case, found in results.items():
        assert found["logits"] <= 1e-5, (case, found)
        assert found["loss"] <= 1e-5 + 1e-6 * abs(found["loss_value"]), (case, found)
        assert found["grads"] <= 1e-5, (case, found)
        tied = MODELS[case.split("/")[0]][1]["tie_word_embeddings"]
        assert found["tied"] == tied, case  # tied embeddings stay one parameter
        assert "model.layers.1.self_attn.o_proj.weight" in found["sharded_params"], case
        assert "model.embed_tokens.weight" in found["sharded_params"], case
        assert found["plain_params"] == [], case  # norms too: every parameter is a DTensor
