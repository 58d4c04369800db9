"""A transformers MoE model (Qwen3-MoE, built from a tiny config) trained through fntrain: its router
loss joins the trained loss as transformers defines it (fntrain.models.moe_hf)."""

from __future__ import annotations

import pytest
import torch

from fntrain.models.moe import RouterOutput, loss_with_router_aux
from fntrain.models.moe_hf import router_aux_coef, router_aux_forward

transformers = pytest.importorskip("transformers")


def _qwen3_moe(coef: float = 0.5) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=coef, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def moe_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # padding: transformers masks it out of the router loss too
    labels[1, -3:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_the_trained_loss_is_transformers_loss_with_its_router_term():
    model, batch = _qwen3_moe(), moe_batch()
    output = router_aux_forward(model, batch)
    assert isinstance(output, RouterOutput) and output.aux_loss is not None
    ours = loss_with_router_aux(output, batch)
    theirs = model(**batch, output_router_logits=True)  # labels given: CE + coef x aux, their way
    torch.testing.assert_close(ours, theirs.loss)
    torch.testing.assert_close(output.aux_loss, 0.5 * theirs.aux_loss)
    ours.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router learns from it


def test_evaluation_and_dense_models_get_the_plain_loss():
    model, batch = _qwen3_moe(), moe_batch()
    model.eval()
    with torch.no_grad():
        output = router_aux_forward(model, batch)
        assert not isinstance(output, RouterOutput)
        plain = model(**{k: v for k, v in batch.items()})
    torch.testing.assert_close(loss_with_router_aux(output, batch), plain.loss)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ))  # fmt: skip
    assert router_aux_coef(dense) is None and router_aux_coef(model) == 0.5
    assert not isinstance(router_aux_forward(dense, batch), RouterOutput)
