"""The MoE layer as plain function calls: routing, dropless dispatch, the aux loss, the loss-free bias,
the step-end metrics, active-parameter FLOPs, and the tiny GPT's MoE flags (fntrain.models.moe)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.models.moe import (
    MoE,
    RouterOutput,
    expert_counts,
    load_balancing_loss,
    loss_with_router_aux,
    moe_step_end,
    route,
    update_expert_bias,
)
from recipes.tiny_gpt import Config


def test_route_picks_top_k_by_probability_and_renormalises():
    torch.manual_seed(0)
    logits = torch.randn(10, 6)
    routing = route(logits, 2)
    probs = torch.softmax(logits, -1)
    assert torch.equal(routing.experts, probs.topk(2).indices)
    chosen = probs.gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(10))
    # Mixtral's form: softmax over the top-k logits gives the same weights.
    torch.testing.assert_close(routing.weights, torch.softmax(logits.gather(-1, routing.experts), -1))
    assert torch.equal(routing.counts, torch.bincount(routing.experts.reshape(-1), minlength=6))


def test_route_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([-10.0, 0.0, 0.0, 0.0])  # expert 0 made unattractive for selection only
    routing = route(logits, 2, bias)
    assert sorted(routing.experts[0].tolist()) == [1, 2]
    probs = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(routing.weights[0], probs[routing.experts[0]] / probs[routing.experts[0]].sum())


def test_expert_counts_runs_on_meta():
    experts = torch.tensor([[0, 2], [2, 3]])
    assert expert_counts(experts, 5).tolist() == [1, 0, 2, 1, 0]
    assert expert_counts(experts.to("meta"), 5).shape == (5,)


def test_load_balancing_loss_is_one_when_balanced_and_e_when_collapsed():
    uniform = torch.full((8, 4), 0.25)
    assert float(load_balancing_loss(uniform, torch.tensor([4, 4, 4, 4]), 2)) == pytest.approx(1.0)
    collapsed = torch.zeros(8, 4)
    collapsed[:, 0] = 1.0
    assert float(load_balancing_loss(collapsed, torch.tensor([8, 0, 0, 0]), 1)) == pytest.approx(4.0)


def test_update_expert_bias_moves_against_the_load():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 2, 2, 2]), 0.5)
    assert bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts' MLPs, plus the shared experts."""
    rows = x.reshape(-1, x.size(-1))
    routing = route(moe.router(rows), moe.top_k)
    w_in, w_out = moe.experts.w_in, moe.experts.w_out
    out = []
    for token in range(rows.size(0)):
        y = sum(
            routing.weights[token, k] * (F.gelu(rows[token] @ w_in[e]) @ w_out[e])
            for k, e in enumerate(routing.experts[token].tolist())
        )
        out.append(y + (moe.shared(rows[token]) if moe.shared is not None else 0))
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_dispatch_equals_a_token_by_token_loop(shared):
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, shared=shared)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(moe(x), _reference(moe, x), rtol=1e-5, atol=1e-6)


def test_every_token_is_kept_even_when_all_choose_one_expert():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 100.0  # every token's top-1 is expert 2: no capacity, nothing dropped
    x = torch.rand(2, 6, 8) + 0.1
    out = moe(x)
    assert moe.step_load.tolist() == [0, 0, 12, 0]
    torch.testing.assert_close(out, _reference(moe, x), rtol=1e-5, atol=1e-6)


def test_aux_loss_only_in_training_and_weighted():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2, aux_loss_weight=0.5)
    x = torch.randn(2, 4, 8)
    moe(x)
    routing = route(moe.router(x.reshape(-1, 8)), 2)
    expected = 0.5 * load_balancing_loss(routing.probs, routing.counts, 2)
    torch.testing.assert_close(moe.aux_loss, expected)
    moe.eval()
    moe(x)
    assert moe.aux_loss is None
    assert moe.step_forwards == 1  # evaluation does not count towards the step's load


def test_loss_with_router_aux_adds_the_term_and_its_gradient():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=8, n_layer=1, n_head=2, d_model=16, experts=4, router_aux_loss_weight=1.0))
    ids = torch.randint(0, 256, (2, 8))
    batch = {"input_ids": ids, "labels": ids}
    out = model(ids)
    assert isinstance(out, RouterOutput) and out.aux_loss is not None
    loss = loss_with_router_aux(out, batch)
    torch.testing.assert_close(loss, F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)) + out.aux_loss)
    out.aux_loss.backward()
    assert model.blocks[0].moe.router.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        out = model(ids)
    assert out.aux_loss is None
    torch.testing.assert_close(loss_with_router_aux(out, batch), F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)))


def test_step_end_updates_the_bias_reports_load_and_resets():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=8, n_layer=2, n_head=2, d_model=16, experts=4, router_bias_rate=0.1))
    ids = torch.randint(0, 256, (4, 8))
    model(ids)
    model(ids)  # two micro-batches
    layers = [block.moe for block in model.blocks]
    loads = [layer.step_load.clone() for layer in layers]
    aux = [layer.step_aux / 2 for layer in layers]
    metrics = moe_step_end(model)()
    assert sorted(metrics) == ["moe/aux_loss", "moe/load_max_mean/0", "moe/load_max_mean/1"]
    for index, (layer, load) in enumerate(zip(layers, loads, strict=True)):
        assert int(load.sum()) == 2 * 4 * 8 * 2  # 2 forwards x 32 tokens x top-2
        assert float(metrics[f"moe/load_max_mean/{index}"]) == pytest.approx(float(load.max() / load.float().mean()))
        expected = 0.1 * torch.sign(load.float().mean() - load.float())
        torch.testing.assert_close(layer.expert_bias, expected)
        assert int(layer.step_load.sum()) == 0 and layer.step_forwards == 0
    assert float(metrics["moe/aux_loss"]) == pytest.approx(float(torch.stack(aux).mean()))
    assert moe_step_end(model)() == {}  # no training forward since: nothing to report


def test_expert_bias_is_in_the_state_dict_and_accumulators_are_not():
    model = TinyGPT(ModelConfig(context=8, n_layer=1, n_head=2, d_model=16, experts=4))
    keys = set(model.state_dict())
    assert {"blocks.0.moe.expert_bias", "blocks.0.moe.experts.w_in", "blocks.0.moe.experts.w_out"} <= keys
    assert not any("step_load" in key or "step_aux" in key for key in keys)


def test_flops_count_active_experts_only():
    from fntrain.models.flops import measure_flops_per_token

    ids = torch.randint(0, 256, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    shape = dict(context=16, n_layer=2, n_head=2, d_model=32)
    dense = measure_flops_per_token(lambda: TinyGPT(ModelConfig(**shape)), batch)
    # 8 experts of the dense MLP's width, 2 per token: two MLPs' FLOPs per token, not eight.
    moe = measure_flops_per_token(lambda: TinyGPT(ModelConfig(**shape, experts=8)), batch, loss_fn=loss_with_router_aux)
    mlp = 3 * 2 * 2 * 32 * 128 * 2  # fwd+bwd x two matmuls x 2 FLOPs/MAC x d x 4d x layers
    assert moe - dense == pytest.approx(mlp, rel=0.1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(model=ModelConfig(experts=4, experts_per_token=5)), "model.experts_per_token must be <= 4"),
        (dict(model=ModelConfig(experts=4, router_aux_loss_weight=-1.0)), "model.router_aux_loss_weight must be >= 0"),
    ],
)
def test_model_flags_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        Config(**overrides).validate()


def test_expert_parallel_needs_experts_fsdp2_and_a_divisor():
    from fntrain.runtime.parallel import ParallelConfig

    with pytest.raises(ValueError, match="parallel.ep_size 2 needs a model with experts"):
        Config(parallel=ParallelConfig(strategy="fsdp2", ep_size=2)).validate()
    with pytest.raises(ValueError, match=r"parallel.ep_size \(4\) must divide model.experts \(6\)"):
        Config(model=ModelConfig(experts=6), parallel=ParallelConfig(strategy="fsdp2", ep_size=4)).validate()
    with pytest.raises(ValueError, match="parallel.ep_size=2 needs parallel.strategy 'fsdp2'"):
        Config(model=ModelConfig(experts=4), parallel=ParallelConfig(strategy="ddp", ep_size=2)).validate()
    with pytest.raises(ValueError, match="cannot be combined with parallel.tp_size"):
        Config(model=ModelConfig(experts=4), parallel=ParallelConfig(strategy="fsdp2", tp_size=2)).validate()


def test_mesh_layout_borrows_ep_from_dp():
    from fntrain.mesh_layout import group_ranks, mesh_dims, rank_coordinates

    dims = mesh_dims(8, ep_size=2, tp_size=2)
    assert dims == (("dp_mod_ep", 2), ("ep", 2), ("tp", 2))
    assert rank_coordinates(5, dims) == {"dp_mod_ep": 1, "ep": 0, "tp": 1, "dp": 2}
    assert group_ranks(5, dims, "ep") == [5, 7]
    assert group_ranks(5, dims, "dp_mod_ep") == [1, 5]
    assert group_ranks(5, dims, "dp") == [1, 3, 5, 7]
    with pytest.raises(ValueError, match=r"parallel.ep_size \(3\) must divide the data-parallel size \(4\)"):
        mesh_dims(4, ep_size=3)


def test_plan_counts_each_ranks_experts_only_in_what_it_gathers():
    from fntrain.plan.memory import plan_memory
    from fntrain.run.config import TrainConfig
    from fntrain.runtime.parallel import ParallelConfig
    from recipes.tiny_gpt import model_config

    def memory(ep: int) -> dict:
        config = Config(model=ModelConfig(experts=8), train=TrainConfig(global_batch_size=32, micro_batch_size=8),
                        parallel=ParallelConfig(strategy="fsdp2", ep_size=ep))  # fmt: skip
        return plan_memory(config, lambda c: TinyGPT(model_config(c)), 4)

    one, two = memory(1), memory(2)
    assert one["model_params"] == two["model_params"] and one["params_per_rank"] == two["params_per_rank"]
    # 4 blocks x 8 experts x (2 x 128 x 512) expert weights; with ep 2 a gathered block holds 4 of its 8.
    per_block_experts = 8 * 2 * 128 * 512
    saved = one["transient_weights"] - two["transient_weights"]
    assert saved == 4 * 3 * (per_block_experts // 2)  # fp32, the 3 blocks FSDP2 holds gathered at once


def test_ep_must_divide_the_data_parallel_ranks_before_any_work():
    from fntrain.config import ConfigError
    from fntrain.run.checks import check_values
    from fntrain.run.config import TrainConfig
    from fntrain.runtime.parallel import ParallelConfig

    config = Config(model=ModelConfig(experts=4), parallel=ParallelConfig(strategy="fsdp2", ep_size=4),
                    train=TrainConfig(global_batch_size=8, micro_batch_size=2))  # fmt: skip
    with pytest.raises(ConfigError, match=r"--parallel.ep-size 4 must divide the data-parallel size \(2\)"):
        check_values(config, 2)
    assert check_values(config, 4) == 4
