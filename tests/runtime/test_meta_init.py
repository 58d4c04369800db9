"""Meta-device build (issue 12, item 1): construct on meta, parallelize, materialize, then a seeded init
identical to an eager build of the same seed (weights, ties and the RNG state after it), or a load.
1-process and 1-rank FSDP2 (real gloo group, in-process) here; 2 ranks under torchrun in the slow tier."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.runtime.materialize import (
    build_model,
    build_on_meta,
    init_weights,
    local_numel,
    materialize,
    params_on_meta,
    replay_plan,
    seeded_init,
)
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from tests.runtime.scale_worker import launch_scale_case

MODEL = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)
SEED = 7


def tiny_gpt_init(seed: int = SEED):
    return seeded_init(seed, post_init=TinyGPT._init)


def eager(seed: int = SEED, model: ModelConfig = MODEL) -> tuple[TinyGPT, torch.Tensor]:
    torch.manual_seed(seed)
    built = TinyGPT(model)
    return built, torch.get_rng_state()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def assert_same_module_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(_plain(sa[name]), _plain(sb[name])), name


class WithBuffers(nn.Module):
    """A persistent and a non-persistent buffer computed in __init__, like rotary frequencies."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("freqs", torch.arange(4, dtype=torch.float32) / 4, persistent=False)
        self.register_buffer("scale", torch.full((3,), 2.0))


# ----------------------------------------------------------------------------- building on meta


def test_params_on_meta_draws_nothing_keeps_buffers_real_and_ties_tied():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    model = build_on_meta(lambda: TinyGPT(MODEL))
    assert torch.equal(torch.get_rng_state(), before)  # reset_parameters ran on meta: no RNG draw
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.tok.weight
    buffers = build_on_meta(WithBuffers)
    assert buffers.linear.weight.is_meta and not buffers.freqs.is_meta
    assert torch.equal(buffers.freqs, torch.arange(4) / 4)
    with params_on_meta():
        pass
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def test_params_on_meta_restores_the_patch_when_the_factory_fails():
    def broken() -> nn.Module:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_on_meta(broken)
    assert not nn.Linear(2, 2).weight.is_meta


def test_materialize_allocates_meta_tensors_and_keeps_real_buffers(caplog):
    model = materialize(build_on_meta(WithBuffers), "cpu")
    assert not any(t.is_meta for t in model.state_dict().values())
    assert torch.equal(model.freqs, torch.arange(4) / 4) and torch.equal(model.scale, torch.full((3,), 2.0))
    with torch.device("meta"):
        all_meta = WithBuffers()
    materialize(all_meta, "cpu")
    assert "freqs" in caplog.text and "scale" in caplog.text  # undefined values are named


# ----------------------------------------------------------------------------- seeded init == eager


def test_meta_init_equals_eager_init_weights_ties_and_rng_state():
    expected, rng_after = eager()
    model = build_model(lambda: TinyGPT(MODEL), Runtime(), "none", fill=tiny_gpt_init())
    assert_same_module_weights(expected, model)
    assert model.head.weight is model.tok.weight
    assert len(list(model.parameters())) == len(list(expected.parameters()))
    # The global RNG is where the eager build left it: dropout masks of the first steps match too.
    assert torch.equal(torch.get_rng_state(), rng_after)
    ids = torch.randint(0, MODEL.vocab_size, (2, MODEL.context), generator=torch.Generator().manual_seed(1))
    state = torch.get_rng_state()
    out_meta = model.train()(ids)
    torch.set_rng_state(state)
    assert torch.equal(out_meta, expected.train()(ids))


def test_another_seed_gives_other_weights():
    a = build_model(lambda: TinyGPT(MODEL), Runtime(), "none", fill=tiny_gpt_init(1))
    b = build_model(lambda: TinyGPT(MODEL), Runtime(), "none", fill=tiny_gpt_init(2))
    assert not torch.equal(a.tok.weight, b.tok.weight)
    assert_same_module_weights(a, eager(1)[0])


def test_replay_plan_is_reset_parameters_in_module_order_then_post_init_in_apply_order():
    model = build_on_meta(lambda: TinyGPT(MODEL))
    steps = list(replay_plan(model, post_init=TinyGPT._init))
    resets = [module for module, fn in steps if fn is not TinyGPT._init]
    assert resets == [m for m in model.modules() if hasattr(m, "reset_parameters")]
    visited = []
    model.apply(visited.append)
    assert [module for module, fn in steps if fn is TinyGPT._init] == visited


def test_a_custom_plan_sees_full_size_plain_parameters_and_later_steps_see_earlier_values():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 2))  # eager: drawn in __init__

    torch.manual_seed(3)
    expected = Scaled()
    with torch.no_grad():
        expected.weight.mul_(2)

    def plan(model: nn.Module):
        yield model, lambda m: m.weight.normal_()
        yield model, lambda m: m.weight.mul_(2)  # reads what the first step wrote

    model = build_model(Scaled, Runtime(), "none", fill=seeded_init(3, plan=plan))
    assert torch.equal(model.weight, expected.weight)


def test_init_weights_on_plain_parameters_writes_in_place():
    model = materialize(build_on_meta(lambda: nn.Linear(3, 2)), "cpu")
    weight = model.weight
    init_weights(model, [(model, lambda m: (m.weight.fill_(1.5), m.bias.fill_(-1)))])
    assert model.weight is weight and torch.all(model.weight == 1.5) and torch.all(model.bias == -1)


def test_tiny_gpt_recipe_meta_init_flag_builds_the_same_model(tmp_path):
    from recipes import tiny_gpt

    config = tiny_gpt.Config(run_dir=str(tmp_path), model=MODEL, seed=5)
    plain = tiny_gpt.build_model(config, Runtime())
    meta_config = tiny_gpt.Config(
        run_dir=str(tmp_path), model=MODEL, seed=5, parallel=ParallelConfig(meta_init=True)
    )
    meta = tiny_gpt.build_model(meta_config, Runtime())
    assert_same_module_weights(plain, meta)


def test_meta_init_flag_is_validated():
    with pytest.raises(TypeError, match=r"parallel\.meta_init"):
        ParallelConfig(meta_init="yes").validate()  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- real 1-rank gloo group


@pytest.fixture
def gloo_runtime_for(one_rank_env):
    def runtime(parallel: ParallelConfig):
        return setup_runtime(RuntimeConfig(), parallel, seed=SEED)

    return runtime


def test_fsdp2_meta_init_equals_eager_then_sharded_and_trains_alike(gloo_runtime_for):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    fsdp = ParallelConfig(strategy="fsdp2")
    no_dropout = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    with gloo_runtime_for(fsdp) as runtime:
        torch.manual_seed(SEED)
        expected = parallelize(TinyGPT(no_dropout), runtime, fsdp)
        model = build_model(lambda: TinyGPT(no_dropout), runtime, fsdp, fill=tiny_gpt_init())
        assert isinstance(model, FSDPModule) and all(isinstance(p, DTensor) for p in model.parameters())
        assert model.head.weight is model.tok.weight
        assert_same_module_weights(expected, model)
        ids = torch.randint(0, no_dropout.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
        losses = []
        for net in (expected, model):
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
            for _ in range(2):
                loss = torch.nn.functional.cross_entropy(net(ids).flatten(0, 1), ids.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1])
        assert_same_module_weights(expected, model)


def test_fsdp2_init_works_one_module_at_a_time(gloo_runtime_for, monkeypatch):
    from fntrain.runtime import materialize as materialize_module

    sizes: list[int] = []
    full_twin = materialize_module._full_twin
    monkeypatch.setattr(
        materialize_module, "_full_twin", lambda *a: sizes.append(a[0].numel()) or full_twin(*a)
    )
    fsdp = ParallelConfig(strategy="fsdp2")
    with gloo_runtime_for(fsdp) as runtime:
        model = build_model(lambda: TinyGPT(MODEL), runtime, fsdp, fill=tiny_gpt_init())
        largest = max(p.numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        assert sizes and max(sizes) == largest < total  # never more than one module's own parameters
        assert local_numel(model) == total  # one rank: its shard is everything


def test_ddp_meta_init_materializes_before_wrapping(gloo_runtime_for):
    from torch.nn.parallel import DistributedDataParallel

    ddp = ParallelConfig(strategy="ddp")
    with gloo_runtime_for(ddp) as runtime:
        model = build_model(lambda: TinyGPT(MODEL), runtime, ddp, fill=tiny_gpt_init())
        assert isinstance(model, DistributedDataParallel)
        assert_same_module_weights(eager()[0], model.module)


# ----------------------------------------------------------------------------- slow: 2 ranks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_rank_fsdp2_meta_init_equals_eager_init(tmp_path):
    out = tmp_path / "meta.pt"
    launch_scale_case("meta", out)
    result = torch.load(out)
    assert result["world_size"] == 2
    assert result["eager"].keys() == result["meta"].keys()
    for name, tensor in result["eager"].items():
        assert torch.equal(tensor, result["meta"][name]), name
    assert result["rng_equal"] and result["tied"] and result["logits_equal"]
    assert result["local_numel"] * 2 == result["global_numel"]  # each rank holds half, never the whole
