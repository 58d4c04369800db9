"""`fntrain.models.moe_hf_ep` in one process: transformers' MoE experts modules (Qwen3-MoE, Qwen2-MoE,
Mixtral, built from tiny configs) made ep-aware keep transformers' forward while `ep_group` is None,
and over a 1-rank gloo ep group (sharded by `shard_experts`) give transformers' logits, router loss and
gradients; unsupported layouts and the recipe's bad ep settings are refused. Two ranks through
hf_causal_lm: tests/models/test_moe_hf_distributed.py (slow tier)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fntrain.models.moe_hf_ep import (
    check_expert_parallel,
    config_num_experts,
    enable_expert_parallel,
    expert_parallel_forward,
    hf_experts_modules,
)
from fntrain.runtime.expert_parallel import expert_modules, shard_experts
from tests.runtime.conftest import one_rank_mesh

transformers = pytest.importorskip("transformers")
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, router_aux_loss_coef=0.5,
            max_position_embeddings=32)  # fmt: skip


def _model(family: str) -> torch.nn.Module:
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**TINY, moe_intermediate_size=16, num_experts=4)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**TINY, moe_intermediate_size=16, num_experts=4,
                                             shared_expert_intermediate_size=16)  # fmt: skip
        cls = transformers.Qwen2MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**TINY, num_local_experts=4)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return cls(config)


@pytest.fixture
def ep_mesh(tmp_path):
    """A 1-rank gloo group and its one-dimensional "ep" DeviceMesh."""
    with one_rank_mesh(tmp_path, "ep") as mesh:
        yield mesh


def masked_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
        for name, p in model.named_parameters() if p.grad is not None
    }  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_ep_aware_experts_train_like_transformers_own(ep_mesh, family):
    reference = _model(family)
    model = copy.deepcopy(reference)
    modules = enable_expert_parallel(model)
    assert len(modules) == 2 and expert_modules(model) == modules  # the ones shard_experts will find
    assert enable_expert_parallel(model) == modules  # idempotent: the forward is wrapped once
    batch = masked_batch()
    with torch.no_grad():  # ep_group None: transformers' own forward, bit for bit
        assert torch.equal(model(**batch).logits, reference(**batch).logits)
    assert shard_experts(model, ep_mesh) == modules
    assert all(m.ep_group is not None and hasattr(m.gate_up_proj, "placements") for m in modules)
    want = reference(**batch, output_router_logits=True)
    got = model(**batch, output_router_logits=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, want.aux_loss)
    (got.logits.square().mean() + got.aux_loss).backward()
    (want.logits.square().mean() + want.aux_loss).backward()
    got_grads, want_grads = _grads(model), _grads(reference)
    assert got_grads.keys() == want_grads.keys()
    assert any("gate_up_proj" in name for name in got_grads)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_forward_matches_with_idle_experts_and_scales_by_router_weight(ep_mesh):
    """Every row to experts 1 and 3 (0 and 2 idle, still in the graph: zero gradients), uneven weights."""
    experts = enable_expert_parallel(_model("qwen3_moe"))[0]
    reference = copy.deepcopy(experts)
    experts.ep_group = ep_mesh.get_group()
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    index = torch.tensor([[1, 3], [3, 1], [1, 3], [3, 1], [1, 3]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    got = expert_parallel_forward(experts, hidden, index, weights)
    want = reference(hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(expert_parallel_forward(experts, hidden, index, 2 * weights), 2 * want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(experts.gate_up_proj.grad, reference.gate_up_proj.grad, rtol=1e-5, atol=1e-7)
    assert experts.down_proj.grad[[0, 2]].abs().sum() == 0 and experts.down_proj.grad[[1, 3]].abs().sum() > 0


def test_unsupported_layouts_and_dense_models_are_told_apart():
    model = _model("qwen3_moe")
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ))  # fmt: skip
    assert enable_expert_parallel(dense) == [] and not hasattr(dense.model.layers[0].mlp, "ep_group")
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts has a layout .* \(is_transposed\)"):
        hf_experts_modules(model)
    assert config_num_experts({"num_local_experts": 8}) == 8
    assert config_num_experts({"text_config": {"num_experts": 4}}) == 4
    assert config_num_experts({"num_attention_heads": 4}) is None


def test_check_expert_parallel_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 6}))
    check_expert_parallel(str(tmp_path), 1)
    check_expert_parallel(str(tmp_path), 2)
    with pytest.raises(
        ValueError, match=r"parallel.ep_size \(4\) must divide the model's number of experts \(6\)"
    ):
        check_expert_parallel(str(tmp_path), 4)
    with pytest.raises(ValueError, match="lora.rank > 0 cannot be combined with parallel.ep_size=2"):
        check_expert_parallel(str(tmp_path), 2, lora=True)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="parallel.ep_size=2 needs a mixture-of-experts model"):
        check_expert_parallel(str(tmp_path), 2)


def test_the_recipe_refuses_bad_ep_settings_in_one_line(tmp_path, capsys):
    """Phase 1 (before any model work; the run directory is not created): a dense model, experts ep
    does not divide, LoRA with ep."""
    from fntrain.cli import dispatch

    model_dir, data_path = tmp_path / "model", tmp_path / "chat.jsonl"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"")
    data_path.write_text(json.dumps({"text": "Hail."}) + "\n")
    ep = ["--parallel.strategy", "fsdp2", "--parallel.ep-size"]
    for saved, args, words in (
        ({"num_attention_heads": 4}, [*ep, "2"], "--parallel.ep-size=2 needs a mixture-of-experts model"),
        ({"num_experts": 6}, [*ep, "4"], "--parallel.ep-size (4) must divide the model's number of experts (6)"),
        ({"num_local_experts": 4}, [*ep, "2", "--lora.rank", "4"],
         "--lora.rank > 0 cannot be combined with --parallel.ep-size=2"),
    ):  # fmt: skip
        (model_dir / "config.json").write_text(json.dumps(saved))
        with pytest.raises(SystemExit) as exit_info:
            dispatch(["run", "recipes.hf_causal_lm", "--model.path", str(model_dir), "--data.path", str(data_path),
                      "--run-dir", str(tmp_path / "run"), *args])  # fmt: skip
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def _recipe_config(model_dir, ep: int, **model):
    from fntrain.models.hf_config import HFModelConfig
    from fntrain.runtime.parallel import ParallelConfig
    from recipes import hf_causal_lm as hf

    return hf.Config(model=HFModelConfig(path=str(model_dir), **model), data=hf.DataConfig(path="unused.jsonl"),
                     parallel=ParallelConfig(strategy="fsdp2", ep_size=ep))  # fmt: skip


def test_the_recipe_plans_experts_per_rank_and_checks_their_layout_on_meta(tmp_path):
    """`plan` (the meta-built model_factory) counts E / ep experts in a rank's gathered weights; the
    recipe's phase-1 check refuses an experts module of another layout (gpt-oss: transposed, biased)."""
    from fntrain.plan.memory import plan_memory
    from recipes import hf_causal_lm as hf

    transformers.Qwen3MoeConfig(**TINY, moe_intermediate_size=16, num_experts=4).save_pretrained(
        tmp_path / "qwen"
    )
    transient = {ep: plan_memory(_recipe_config(tmp_path / "qwen", ep), hf.model_factory, 2)["transient_weights"]
                 for ep in (1, 2)}  # fmt: skip
    experts_bytes = 2 * 4 * (2 * 16 * 32 + 32 * 16) * 4  # two gathered blocks' fp32 experts
    assert transient[1] - transient[2] == experts_bytes // 2
    hf.check(_recipe_config(tmp_path / "qwen", 2), None)
    transformers.GptOssConfig(**{**TINY, "intermediate_size": 16}, num_local_experts=4).save_pretrained(
        tmp_path / "oss"
    )
    with pytest.raises(ValueError, match=r"GptOssExperts has a layout expert parallelism does not support"):
        hf.check(_recipe_config(tmp_path / "oss", 2, attn_implementation="eager"), None)
