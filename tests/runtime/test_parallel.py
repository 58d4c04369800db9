"""parallelize (§5) [S21]: none / DDP / FSDP2 (per block, then the root) with mixed precision,
activation checkpointing and compile; unsupported degrees rejected clearly. The DDP/FSDP2 cases run on
a real 1-rank gloo group in-process (2-rank equivalence lives in tests/runtime/test_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.parallel import ParallelConfig, parallelize, transformer_blocks
from fntrain.runtime.precision import autocast_dtype, build_grad_scaler
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step

VOCAB = 13


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.ff(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def parallel_batches(steps: int = 2) -> list[list[dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 5), generator=generator)
        labels = ids.clone()
        labels[0, 2:] = -100
        out.append(
            [{"input_ids": ids[:2], "labels": labels[:2]}, {"input_ids": ids[2:], "labels": labels[2:]}]
        )
    return out


def train(
    model: nn.Module, runtime: Runtime, steps: int = 2, grad_scaler: object = None
) -> tuple[list[torch.Tensor], dict]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step_fn = make_train_step(
        model,
        causal_lm_loss,
        optimizer,
        settings=StepSettings(max_grad_norm=1.0, dp_size=runtime.dp_size, dp_group=data_parallel_group(runtime)),
        grad_scaler=grad_scaler,
    )
    losses, state = [], TrainState()
    for batch in parallel_batches(steps):
        losses.append(step_fn(state, batch)["loss"])
        state = state.after_step()
    weights = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        weights[name.removeprefix("module.")] = value.detach().clone()
    return losses, weights


# ----------------------------------------------------------------------------- config and rejections


def test_parallel_config_validation_names_the_field():
    with pytest.raises(ValueError, match="parallel.strategy must be one of"):
        ParallelConfig(strategy="zero3").validate()
    with pytest.raises(ValueError, match="parallel.mixed_precision must be one of"):
        ParallelConfig(mixed_precision="fp8").validate()
    with pytest.raises(ValueError, match="parallel.tp_size must be >= 1"):
        ParallelConfig(tp_size=0).validate()
    with pytest.raises(TypeError, match="parallel.compile must be a bool"):
        ParallelConfig(compile="yes").validate()


def test_expert_parallelism_cannot_be_combined_with_context_parallelism():
    with pytest.raises(ValueError, match=r"parallel.ep_size=2 cannot be combined with parallel.cp_size=2"):
        ParallelConfig(strategy="fsdp2", ep_size=2, cp_size=2).validate()


def test_context_parallelism_needs_a_data_parallel_strategy():
    with pytest.raises(ValueError, match=r"--parallel.cp-size 2 needs --parallel.strategy ddp or fsdp2"):
        parallelize(make_stack(), Runtime(cp_size=2), "none")


def test_expert_parallelism_needs_fsdp2():
    with pytest.raises(ValueError, match="parallel.ep_size=2 needs parallel.strategy 'fsdp2', got 'none'"):
        parallelize(make_stack(), Runtime(), ParallelConfig(ep_size=2))


@pytest.mark.parametrize("field", ["tp_size", "pp_size", "ep_size"])
def test_tensor_and_pipeline_parallelism_need_the_mesh(field):
    with pytest.raises(RuntimeError, match="need the runtime's DeviceMesh: use setup_runtime"):
        parallelize(make_stack(), Runtime(**{field: 2}), "none")


def test_tensor_and_pipeline_parallelism_refuse_ddp_fp16_and_meta_init():
    with pytest.raises(ValueError, match=r"parallel.strategy 'ddp' cannot be combined with parallel.tp_size=2"):
        ParallelConfig(strategy="ddp", tp_size=2).validate()
    with pytest.raises(ValueError, match=r"'fp16' needs a gradient scaler.*use bf16 with parallel.pp_size=2"):
        ParallelConfig(pp_size=2, mixed_precision="fp16").validate()
    with pytest.raises(ValueError, match=r"parallel.meta_init is not supported with parallel.pp_size=2"):
        ParallelConfig(pp_size=2, meta_init=True).validate()
    with pytest.raises(ValueError, match=r"parallel.pp_schedule must be one of"):
        ParallelConfig(pp_size=2, pp_schedule="zb").validate()  # type: ignore[arg-type]
    ParallelConfig(strategy="fsdp2", tp_size=2, pp_size=2, mixed_precision="bf16").validate()


def test_none_with_several_data_parallel_ranks_is_rejected():
    with pytest.raises(ValueError, match="parallel.strategy 'none' cannot train with 2 data-parallel ranks"):
        parallelize(make_stack(), Runtime(world_size=2, dp_size=2), "none")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_data_parallel_without_a_process_group_says_to_use_torchrun(strategy):
    with pytest.raises(RuntimeError, match="needs an initialized process group: launch with torchrun"):
        parallelize(make_stack(), Runtime(), strategy)


def test_unknown_strategy_name_is_rejected():
    with pytest.raises(ValueError, match="parallel.strategy must be one of"):
        parallelize(make_stack(), Runtime(), "zero3")


# ----------------------------------------------------------------------------- blocks, precision choices


def test_blocks_are_the_longest_module_list_or_hf_no_split_modules():
    model = make_stack()
    assert transformer_blocks(model) == list(model.blocks)

    class HFStyle(Stack):
        _no_split_modules = ["LayerNorm"]

    hf = HFStyle()
    assert transformer_blocks(hf) == [block.norm for block in hf.blocks]
    assert transformer_blocks(nn.Linear(2, 2)) == []


def test_autocast_and_scaler_follow_strategy_and_precision():
    assert autocast_dtype(ParallelConfig()) is None
    assert autocast_dtype(ParallelConfig(strategy="ddp", mixed_precision="bf16")) is torch.bfloat16
    assert autocast_dtype(ParallelConfig(mixed_precision="fp16")) is torch.float16
    assert (
        autocast_dtype(ParallelConfig(strategy="fsdp2", mixed_precision="bf16")) is None
    )  # the policy casts
    assert build_grad_scaler(ParallelConfig(mixed_precision="bf16"), Runtime()) is None
    scaler = build_grad_scaler(ParallelConfig(strategy="ddp", mixed_precision="fp16"), Runtime())
    assert type(scaler) is torch.amp.GradScaler


# ----------------------------------------------------------------------------- activation checkpointing, compile


def test_activation_checkpointing_recomputes_blocks_and_keeps_gradients_and_names():
    reference = make_stack()
    expected_losses, expected = train(reference, Runtime())
    model = parallelize(make_stack(), Runtime(), ParallelConfig(activation_checkpointing=True))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    losses, weights = train(model, Runtime())
    torch.testing.assert_close(losses, expected_losses)
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name])
    # 2 steps x 2 micro-batches: each block ran forward twice per micro-batch (once more in backward).
    assert [block.calls for block in model.blocks] == [8, 8, 8]
    assert [block.calls for block in reference.blocks] == [4, 4, 4]


def test_compile_compiles_each_block_in_place():
    model = parallelize(make_stack(), Runtime(), ParallelConfig(compile=True, compile_backend="eager"))
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None
    assert "blocks.0.ff.weight" in model.state_dict()
    ids = torch.randint(0, VOCAB, (2, 5))
    torch.testing.assert_close(model(ids), make_stack()(ids))


# ----------------------------------------------------------------------------- real 1-rank gloo group


@pytest.fixture
def gloo_runtime(one_rank_env):
    with setup_runtime(RuntimeConfig()) as runtime:
        yield runtime


def test_ddp_trains_like_the_plain_model(gloo_runtime):
    from torch.nn.parallel import DistributedDataParallel

    expected_losses, expected = train(make_stack(), Runtime())
    model = parallelize(make_stack(), gloo_runtime, "ddp")
    assert isinstance(model, DistributedDataParallel)
    losses, weights = train(model, gloo_runtime)
    torch.testing.assert_close(losses, expected_losses)
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name])


def test_fsdp2_shards_each_block_then_the_root_and_trains_like_the_plain_model(gloo_runtime):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    expected_losses, expected = train(make_stack(), Runtime())
    model = parallelize(make_stack(), gloo_runtime, ParallelConfig(strategy="fsdp2"))
    assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    losses, weights = train(model, gloo_runtime)
    torch.testing.assert_close(losses, expected_losses)
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name])


def test_fsdp2_bf16_policy_computes_in_bf16_and_keeps_fp32_weights(gloo_runtime):
    model = parallelize(make_stack(), gloo_runtime, ParallelConfig(strategy="fsdp2", mixed_precision="bf16"))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded (optimizer) weights
    losses, weights = train(model, gloo_runtime, steps=1)
    assert torch.isfinite(losses[0]) and losses[0].dtype == torch.float32
    assert all(w.dtype == torch.float32 for w in weights.values())
    with torch.no_grad():
        assert model(torch.randint(0, VOCAB, (2, 5))).dtype == torch.bfloat16  # computed in bf16


def test_fsdp2_fp16_uses_a_sharded_grad_scaler(gloo_runtime):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    config = ParallelConfig(strategy="fsdp2", mixed_precision="fp16")
    scaler = build_grad_scaler(config, gloo_runtime)
    assert isinstance(scaler, ShardedGradScaler)
    model = parallelize(make_stack(), gloo_runtime, config)
    losses, weights = train(model, gloo_runtime, grad_scaler=scaler)
    assert all(torch.isfinite(loss) for loss in losses)
    assert all(torch.isfinite(w).all() for w in weights.values())
