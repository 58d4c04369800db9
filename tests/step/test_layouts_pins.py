"""Behaviours of `fntrain.step.layouts` that mutation testing found unpinned (mutation/RESULTS.md): what
each layout builds from the run's parts, and the exact line each rule gives.

- plain: the step is the micro-batch step of the components, with every part the run hands it (the
  spec's forward, the settings, the scaler, the schedulers, step_end); evaluation runs the spec's forward
  and the components' loss (None: the hook's default) unless a loss context wraps it;
- pipeline (one stage over a 1-rank gloo group): the step and evaluation go through the schedule with
  the run's settings (clipping, loss context); a spec's step_end is refused naming --parallel.pp-size;
  the rank's pipeline layout gets the ties of the recipe's split;
- context-parallel (stand-in cp parts, the real ones need several ranks): they are built over the
  runtime's "cp" mesh in the configured style, and the step runs under their context with their forward
  and training loss, evaluation with their forward and evaluation loss;
- the rules: every message, word for word, a valid combination passes, and an entry's rules each see
  the run's config, spec and data-parallel size, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fntrain.config import ConfigError
from fntrain.run.checks import full_model_on_meta
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, layouts, make_train_step
from fntrain.step.components import Components
from fntrain.step.context_parallel import CPParts
from recipes import hf_causal_lm, tiny_gpt
from tests.runtime.conftest import one_rank_env  # noqa: F401 (the fixture: a 1-rank torchrun environment)
from tests.runtime.test_pipeline_step import _model_and_optimizer, pipeline_batches
from tests.step.test_layouts import config_with_parallel
from tests.step.test_train_step import EXACT, make_model, make_samples, split


class Entered:
    """A loss context that counts how often it was entered and says whether it is active."""

    def __init__(self) -> None:
        self.count, self.active = 0, False

    @contextlib.contextmanager
    def __call__(self):
        self.count, self.active = self.count + 1, True
        try:
            yield
        finally:
            self.active = False


def half_forward(model, micro_batch):
    """A spec's forward that differs from the default one (the logits halved)."""
    return model(micro_batch["input_ids"]) * 0.5


def _router_step_end():
    return {"router": torch.tensor(7.0)}


def step_parts(model, scaler=None):
    """Components with an SGD optimizer (lr 0.5) and a schedule that halves it every step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    return Components(model, causal_lm_loss, (optimizer,), (scheduler,), scaler), optimizer


def _inputs(components, settings, parallel=None, runtime=None, step_end=_router_step_end, **extra):
    return layouts.StepInputs(components, settings, half_forward, step_end, runtime, parallel or ParallelConfig(),
                              micro_batches=2, **extra)  # fmt: skip


def _params(model):
    return {name: param.detach().clone() for name, param in model.named_parameters()}


# ----------------------------------------------------------------------------- plain


def test_the_plain_step_is_the_micro_batch_step_of_every_part_the_run_hands_it():
    batch = split(make_samples(4, keep=[0.3, 1.0, 0.6, 0.9]), [1, 3])
    settings = StepSettings(max_grad_norm=0.05)
    model, reference = make_model(), make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    components, optimizer = step_parts(model, scaler)
    laid_out = layouts.choose_layout(ParallelConfig()).build(_inputs(components, settings))
    got = laid_out.step_fn(TrainState(), batch)

    want_components, _ = step_parts(reference, torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1))
    want = make_train_step(reference, causal_lm_loss, want_components.optimizers, want_components.schedulers,
                           settings=settings, grad_scaler=want_components.grad_scaler, forward=half_forward,
                           step_end=_router_step_end)(TrainState(), batch)  # fmt: skip
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(want[key]), **EXACT, msg=key)
    assert got["grad_norm"] > 0.05  # the clipping setting reached the step: the pre-clip norm is reported
    assert got["router"] == 7.0  # step_end's metrics
    assert scaler.get_scale() == 8.0  # the components' scaler scaled the step (and grew after it)
    assert optimizer.param_groups[0]["lr"] == 0.25  # the schedulers stepped
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), param, **EXACT, msg=name)
    assert not torch.equal(model.head.weight, make_model().head.weight)  # and the step updated the weights


def test_plain_evaluation_runs_the_specs_forward_and_the_default_loss_without_a_context():
    components, _ = step_parts(make_model())
    laid_out = layouts.choose_layout(ParallelConfig()).build(
        _inputs(components, StepSettings(), step_end=None)
    )
    assert laid_out.forward is half_forward and laid_out.loss is None


def test_plain_evaluation_loss_is_the_components_loss_inside_the_loss_context():
    entered = Entered()
    components, _ = step_parts(make_model())
    laid_out = layouts.choose_layout(ParallelConfig()).build(
        _inputs(components, StepSettings(loss_context=entered))
    )
    micro_batch = make_samples(2, keep=0.7)
    output = half_forward(components.model, micro_batch)
    assert laid_out.loss(output, micro_batch) == causal_lm_loss(output, micro_batch) and entered.count == 1


# ----------------------------------------------------------------------------- pipeline


def test_a_one_stage_pipeline_steps_and_evaluates_with_the_runs_settings(one_rank_env):  # noqa: F811
    entered = Entered()
    with setup_runtime(RuntimeConfig()) as runtime:
        model, _ = _model_and_optimizer()
        reference, _ = _model_and_optimizer()
        components, optimizer = step_parts(model)
        settings = StepSettings(max_grad_norm=0.05, device=runtime.device, loss_context=entered)
        parallel = ParallelConfig(pp_schedule="gpipe")
        inputs = dataclasses.replace(
            _inputs(components, settings, parallel, runtime, step_end=None), micro_batches=3
        )
        laid_out = layouts.choose_layout(ParallelConfig(pp_size=2)).build(inputs)
        batch = pipeline_batches(steps=1)[0]
        got = laid_out.step_fn(TrainState(), batch)
        reference_parts, _ = step_parts(reference)
        want = make_train_step(reference, causal_lm_loss, reference_parts.optimizers, reference_parts.schedulers,
                               settings=StepSettings(max_grad_norm=0.05))(TrainState(), batch)  # fmt: skip
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["grad_norm"], want["grad_norm"], rtol=1e-5, atol=1e-6)  # clipped, > 0
        assert got["grad_norm"] > 0.05 and entered.count == 1 and optimizer.param_groups[0]["lr"] == 0.25
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name), param, rtol=1e-5, atol=1e-6, msg=name)

        model.eval()
        with torch.no_grad():
            output = laid_out.forward(model, batch[0])
            torch.testing.assert_close(output, model(batch[0]["input_ids"]))
            loss = laid_out.loss(output, batch[0])
        torch.testing.assert_close(loss, causal_lm_loss(output, batch[0]).float())
        assert entered.count == 3  # the evaluation's forward and loss run inside the loss context too


def test_a_pipeline_refuses_a_specs_step_end_naming_the_pp_size():
    components, _ = step_parts(make_model())
    inputs = _inputs(components, StepSettings(), ParallelConfig(pp_size=2), SimpleNamespace(pp_size=2))
    with pytest.raises(
        ValueError, match=r"^--parallel.pp-size 2: this recipe's step_end needs a pipeline-free step$"
    ):
        layouts.choose_layout(inputs.parallel).build(inputs)


def test_the_ranks_pipeline_layout_gets_the_ties_of_the_recipes_split(monkeypatch):
    """tiny_gpt's head shares the token embedding: over two stages, stage 0's tok.weight is stage 1's
    head.weight, and the rank's layout is built from the runtime, the parallel settings and that tie."""
    seen = []

    class Built(Exception):
        pass

    def layout_spy(runtime, parallel, ties=()):
        seen.append((runtime, parallel, ties))
        raise Built

    monkeypatch.setattr(layouts, "pipeline_layout", layout_spy)
    config = config_with_parallel(pp_size=2)
    components, _ = step_parts(make_model())
    runtime = SimpleNamespace(pp_size=2)
    inputs = _inputs(components, StepSettings(), config.parallel, runtime, step_end=None, pipeline=tiny_gpt.spec.pipeline,
                     model_on_meta=lambda: full_model_on_meta(config, tiny_gpt.spec))  # fmt: skip
    with pytest.raises(Built):
        layouts.choose_layout(config.parallel).build(inputs)
    assert seen == [(runtime, config.parallel, [{0: "tok.weight", 1: "head.weight"}])]


# ----------------------------------------------------------------------------- context-parallel


def _cp_parts(calls):
    """Stand-in cp parts (the real ones need several ranks to differ from the plain step): a forward
    that doubles the logits, a training loss three times the loss, an evaluation loss, a context."""
    entered = Entered()

    def forward(model, micro_batch):
        calls.append(entered.active)
        return model(micro_batch["input_ids"]) * 2.0

    def train_loss(output, micro_batch):
        return causal_lm_loss(output, micro_batch) * 3.0

    def eval_loss(output, micro_batch):
        return causal_lm_loss(output, micro_batch)

    return CPParts(forward, train_loss, eval_loss, entered), entered


@pytest.mark.parametrize("style", ["ulysses", "ring"])
def test_context_parallel_parts_are_built_over_the_cp_mesh_in_the_configured_style(monkeypatch, style):
    calls, built = [], []
    parts, _ = _cp_parts(calls)
    monkeypatch.setattr(
        layouts, "context_parallel_parts", lambda *args, **kwargs: built.append((args, kwargs)) or parts
    )
    components, _ = step_parts(make_model())
    parallel = ParallelConfig(cp_size=2, strategy="ddp", cp_style=style)
    runtime = SimpleNamespace(cp_size=2, mesh={"cp": "the cp mesh"})
    layouts.choose_layout(parallel).build(_inputs(components, StepSettings(), parallel, runtime))
    assert built == [((half_forward, causal_lm_loss), {"mesh": "the cp mesh", "style": style})]


def test_the_context_parallel_step_runs_the_parts_under_their_context_and_evaluation_uses_them(monkeypatch):
    calls = []
    parts, entered = _cp_parts(calls)
    monkeypatch.setattr(layouts, "context_parallel_parts", lambda *args, **kwargs: parts)
    batch = split(make_samples(4, keep=[0.3, 1.0, 0.6, 0.9]), [1, 3])
    model, reference = make_model(), make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    components, optimizer = step_parts(model, scaler)
    parallel = ParallelConfig(cp_size=2, strategy="ddp")
    runtime = SimpleNamespace(cp_size=2, mesh={"cp": "the cp mesh"})
    laid_out = layouts.choose_layout(parallel).build(_inputs(components, StepSettings(max_grad_norm=0.05), parallel,
                                                              runtime))  # fmt: skip
    got = laid_out.step_fn(TrainState(), batch)

    reference_parts, _ = step_parts(reference)
    want = make_train_step(reference, parts.train_loss, reference_parts.optimizers, reference_parts.schedulers,
                           settings=StepSettings(max_grad_norm=0.05), forward=parts.forward)(TrainState(), batch)  # fmt: skip
    torch.testing.assert_close(got["loss"], want["loss"], **EXACT)  # the parts' forward and training loss
    assert got["grad_norm"] > 0.05 and got["router"] == 7.0  # the run's settings and step_end
    assert scaler.get_scale() == 8.0 and optimizer.param_groups[0]["lr"] == 0.25  # its scaler, its schedulers
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), param, **EXACT, msg=name)
    assert calls[:2] == [True, True]  # each micro-batch's forward ran inside the parts' context
    assert laid_out.forward is parts.forward and laid_out.loss is parts.eval_loss


# ----------------------------------------------------------------------------- the rules


def _check(config, spec=tiny_gpt.spec, dp_size=1):
    layouts.choose_layout(config.parallel).check(config, spec, dp_size)


def _with_train(config, global_batch_size, micro_batch_size):
    train = dataclasses.replace(
        config.train, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size
    )
    return dataclasses.replace(config, train=train)


@pytest.mark.parametrize("parallel", [{}, {"pp_size": 2}, {"cp_size": 2, "strategy": "ddp"}])
def test_a_recipe_without_a_tensor_parallel_plan_runs_at_tp_1(parallel):
    _check(config_with_parallel(**parallel), dataclasses.replace(tiny_gpt.spec, tensor_parallel=None))


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (
            {"strategy": "none"},
            "--parallel.cp-size 2 needs --parallel.strategy ddp or fsdp2 (each cp rank's "
            "gradients cover only its slice of the sequence)",
        ),
        (
            {"strategy": "fsdp2", "tp_size": 2},
            "--parallel.cp-size 2 cannot be combined with --parallel.tp-size 2 yet",
        ),
        (
            {"strategy": "fsdp2", "replicate": 2},
            "--parallel.cp-size 2 cannot be combined with --parallel.replicate 2 yet",
        ),
        (
            {"strategy": "ddp", "activation_checkpointing": True},
            "--parallel.cp-size 2 cannot be combined with --parallel.activation-checkpointing True yet",
        ),
        (
            {"strategy": "ddp", "compile": True},
            "--parallel.cp-size 2 cannot be combined with --parallel.compile True yet",
        ),
    ],
)
def test_each_context_parallel_refusal_is_its_exact_line(parallel, message):
    with pytest.raises(ConfigError) as refused:
        _check(config_with_parallel(cp_size=2, **parallel))
    assert str(refused.value) == message


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_context_parallel_with_a_data_parallel_strategy_and_nothing_else_passes(strategy):
    _check(config_with_parallel(cp_size=2, strategy=strategy))


def test_context_parallel_names_the_heads_it_cannot_split_and_a_model_it_cannot_split():
    config = config_with_parallel(cp_size=2, strategy="ddp")
    one_head = dataclasses.replace(config, model=dataclasses.replace(config.model, n_head=1, d_model=16))
    with pytest.raises(ConfigError) as refused:
        _check(one_head)
    assert str(refused.value) == "--parallel.cp-size 2 must divide the model's attention heads, got 1"
    with pytest.raises(ConfigError) as refused:
        layouts.check_context_parallel(config, hf_causal_lm.spec)
    assert str(refused.value) == (
        "--parallel.cp-size 2: this recipe's model has no context-parallel attention (use --parallel.cp-size 1)"
    )


@pytest.mark.parametrize(
    ("sizes", "dp_size", "got"),
    [((8, 8), 1, 1), ((8, 2), 2, 2), ((8, 4), 1, 2)],  # (global batch, micro batch): micro-batches per step
)
def test_1f1b_names_the_micro_batches_a_step_has(sizes, dp_size, got):
    config = _with_train(config_with_parallel(pp_size=4), *sizes)
    with pytest.raises(ConfigError) as refused:
        _check(config, dp_size=dp_size)
    assert str(refused.value) == (
        f"--parallel.pp-schedule 1f1b needs at least --parallel.pp-size (4) micro-batches per step, got {got} "
        f"(--train.global-batch-size / (--train.micro-batch-size x {dp_size} data-parallel ranks)): lower "
        "--train.micro-batch-size or use --parallel.pp-schedule gpipe"
    )
    _check(
        _with_train(config_with_parallel(pp_size=4, pp_schedule="gpipe"), *sizes), dp_size=dp_size
    )  # gpipe needs no more


def test_1f1b_with_a_micro_batch_per_stage_passes():
    _check(_with_train(config_with_parallel(pp_size=4), 16, 2), dp_size=2)


def _ring(device):
    config = config_with_parallel(cp_size=2, cp_style="ring", strategy="ddp")
    return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, device=device))


def test_ring_attention_off_cuda_and_npu_is_its_exact_line():
    with pytest.raises(ConfigError) as refused:
        layouts.choose_layout(_ring("cpu").parallel).check_device(_ring("cpu"))
    assert str(refused.value) == (
        "--parallel.cp-style ring needs a CUDA or NPU device (torch's ring attention has no cpu kernel): "
        "use --parallel.cp-style ulysses"
    )


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_ring_attention_runs_on_cuda_and_npu(monkeypatch, device):
    monkeypatch.setattr(layouts, "resolve_device_type", lambda name: name)  # this machine has neither
    layouts.choose_layout(_ring(device).parallel).check_device(_ring(device))


def test_an_entrys_rules_each_see_the_runs_config_spec_and_data_parallel_size_in_order():
    seen = []
    rule = layouts._checks(
        lambda *args: seen.append(("first", *args)), lambda *args: seen.append(("second", *args))
    )
    rule("config", "spec", 3)
    assert seen == [("first", "config", "spec", 3), ("second", "config", "spec", 3)]
