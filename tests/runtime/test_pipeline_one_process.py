"""The rest of `fntrain.step.pipeline` that one process can run (a one-stage pipeline, a real torch
schedule over a 1-rank gloo group): the forward-only evaluation schedule (one per micro-batch shape)
and its loss, position ids fed to the first stage, a tied copy left out of the global gradient norm,
no norm when neither clipping nor skipping needs one, and `pipeline_layout`'s stage, schedule and tie
groups (which ranks share a tie, from the mesh). Several stages: tests/runtime/test_model_parallel.py (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fntrain.runtime.runtime import Runtime
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step.pipeline import PipelineLayout, make_pipeline_eval, make_pipeline_step, pipeline_layout
from tests.runtime.test_pipeline_step import SHAPE, _model_and_optimizer, pipeline_batches


def _with_positions(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Packed-style position ids (restarting mid-row), which change the logits."""
    positions = torch.cat([torch.arange(3), torch.arange(SHAPE.context - 3)]).expand(2, -1)
    return [{**mb, "position_ids": positions.clone()} for mb in batch]


def _grads_at_step(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients the optimizer sees when it steps (the step zeroes them afterwards)."""
    seen: dict[str, torch.Tensor] = {}
    names = {id(p): name for name, p in model.named_parameters()}

    def record(opt, _args, _kwargs):
        for group in opt.param_groups:
            seen.update((names[id(p)], p.grad.clone()) for p in group["params"] if p.grad is not None)

    optimizer.register_step_pre_hook(record)
    return seen


def test_eval_runs_one_forward_schedule_per_shape_and_returns_the_loss(one_rank_env):
    with setup_runtime(RuntimeConfig()) as runtime:
        model, _ = _model_and_optimizer()
        model.eval()
        layout = PipelineLayout(0, 1, dist.group.WORLD)
        forward, loss = make_pipeline_eval(model, causal_lm_loss, layout, runtime.device)
        batch = _with_positions(pipeline_batches(steps=1)[0])
        short = {key: value[:, :5] for key, value in batch[0].items()}
        with torch.no_grad():
            for micro_batch in (batch[0], short, batch[1]):
                want = model(micro_batch["input_ids"], position_ids=micro_batch["position_ids"])
                got = forward(model, micro_batch)
                torch.testing.assert_close(got, want)
                torch.testing.assert_close(loss(got, micro_batch), causal_lm_loss(want, micro_batch).float())


def test_a_tied_copy_counted_elsewhere_is_left_out_of_the_norm(one_rank_env):
    with setup_runtime(RuntimeConfig()) as runtime:
        model, optimizer = _model_and_optimizer()
        reference, reference_optimizer = _model_and_optimizer()
        assert model.head.weight is model.tok.weight
        layout = PipelineLayout(
            0, 1, dist.group.WORLD, "1f1b", (("head.weight", dist.group.WORLD),), (False,)
        )
        step = make_pipeline_step(model, causal_lm_loss, [optimizer], [], layout,
                                  settings=StepSettings(max_grad_norm=1e9, device=runtime.device), micro_batches=3)  # fmt: skip
        plain = make_train_step(reference, causal_lm_loss, reference_optimizer, settings=StepSettings(max_grad_norm=1e9))
        seen, want_seen = _grads_at_step(optimizer, model), _grads_at_step(reference_optimizer, reference)
        batch = pipeline_batches(steps=1)[0]
        got, want = step(TrainState(), batch), plain(TrainState(), batch)
        for name, grad in want_seen.items():  # one stage: the tie's all_reduce leaves its gradient whole
            torch.testing.assert_close(seen[name], grad, rtol=1e-6, atol=1e-7, msg=name)
        others = [grad for name, grad in seen.items() if name != "tok.weight"]
        torch.testing.assert_close(
            got["grad_norm"], torch.nn.utils.get_total_norm(others), rtol=1e-6, atol=1e-7
        )
        assert got["grad_norm"] < want["grad_norm"]  # the plain step counts the tied weight


def test_position_ids_reach_the_first_stage_and_no_norm_is_computed_unless_needed(one_rank_env):
    """Neither clipping nor skipping: the step reports a norm of 0.0 and computes none."""
    with setup_runtime(RuntimeConfig()) as runtime:
        model, optimizer = _model_and_optimizer()
        reference, reference_optimizer = _model_and_optimizer()
        layout = PipelineLayout(0, 1, dist.group.WORLD, "gpipe")
        step = make_pipeline_step(model, causal_lm_loss, [optimizer], [], layout,
                                  settings=StepSettings(device=runtime.device), micro_batches=3)  # fmt: skip
        plain = make_train_step(reference, causal_lm_loss, reference_optimizer)
        batch = _with_positions(pipeline_batches(steps=1)[0])
        got, want = step(TrainState(), batch), plain(TrainState(), batch)
        assert got["grad_norm"] == 0.0
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-7)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name), param, rtol=1e-6, atol=1e-7, msg=name)
        unpositioned, unpositioned_optimizer = _model_and_optimizer()
        other = make_train_step(unpositioned, causal_lm_loss, unpositioned_optimizer)(
            TrainState(), pipeline_batches(steps=1)[0]
        )
        assert not torch.allclose(other["loss"], got["loss"])  # the position ids were used


def test_layout_of_a_single_stage_holds_its_ties_in_the_pipeline_group():
    config = SimpleNamespace(pp_schedule="gpipe")
    layout = pipeline_layout(Runtime(), config, [{0: "tok.weight"}])
    assert (layout.stage, layout.stages, layout.group, layout.schedule) == (0, 1, None, "gpipe")
    assert layout.first and layout.last
    assert layout.ties == (("tok.weight", None),) and layout.tie_counted_here == (True,)


@pytest.mark.parametrize(("rank", "counted"), [(5, False), (3, True), (4, None)])
def test_tie_groups_join_the_holding_stages_of_each_pipeline(monkeypatch, rank, counted):
    """A (dp=2, pp=3) mesh, ranks laid out dp-major: the pipelines are ranks 0-2 and 3-5. A weight tied
    between stages 0 and 2 gets one group per pipeline (every rank creates all, as new_group needs),
    and each rank keeps its own pipeline's; stage 1 holds no copy."""
    created: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: created.append(ranks) or tuple(ranks))
    mesh = SimpleNamespace(mesh_dim_names=("dp", "pp"), mesh=torch.arange(6).reshape(2, 3),
                           get_group=lambda name: f"{name} group")  # fmt: skip
    runtime = Runtime(rank=rank, world_size=6, dp_size=2, pp_size=3, pp_rank=rank % 3, mesh=mesh)
    layout = pipeline_layout(
        runtime, SimpleNamespace(pp_schedule="1f1b"), [{0: "tok.weight", 2: "head.weight"}]
    )
    assert created == [[0, 2], [3, 5]] and layout.group == "pp group" and layout.stages == 3
    if counted is None:
        assert layout.ties == () and layout.tie_counted_here == ()
    else:
        name = "tok.weight" if rank % 3 == 0 else "head.weight"
        assert layout.ties == ((name, (3, 5)),) and layout.tie_counted_here == (counted,)
