"""The layouts a run's step can take, as one table looked up once per run.

    LAYOUTS                 the entries, most specific first: context-parallel, pipeline, plain
    choose_layout(parallel) the entry the parallel settings ask for (the first whose `applies` is true)
    StepInputs              what every layout builds from (the run derives it once)
    LaidOut                 what a layout builds: the train step and the evaluation's (forward, loss)

An entry gives the train step and the evaluation's forward and loss together (`build`: what they share,
the context-parallel parts, is built once) and the layout's rules: `check(config, spec, dp_size)`, what
can be known from the settings and the recipe's spec alone (`fntrain plan` runs it too), and
`check_device(config)`, what needs the machine the run is on. Each rule is a `ConfigError` naming the
flag. Adding a layout is one new entry here and its tests: the run looks the entry up and uses it.

`config` and `spec` are the run's `JobConfig` and `RecipeSpec`, typed `Any` here: the step side sits
below the run and reads only the fields named in each check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fntrain.config import ConfigError
from fntrain.runtime.device import resolve_device_type
from fntrain.runtime.groups import context_parallel_mesh
from fntrain.runtime.materialize import build_on_meta
from fntrain.runtime.pipeline import stage_layers, stage_ties
from fntrain.step.components import Components
from fntrain.step.context_parallel import context_parallel_parts
from fntrain.step.pipeline import make_pipeline_eval, make_pipeline_step, pipeline_layout
from fntrain.step.settings import StepSettings
from fntrain.step.train_step import make_train_step

__all__ = [
    "StepInputs", "LaidOut", "Layout", "LAYOUTS", "choose_layout", "check_tensor_parallel", "check_pipeline",
    "check_context_parallel", "check_ring_device",
]  # fmt: skip


@dataclass(frozen=True)
class StepInputs:
    """What a layout builds from: the built components, the step's settings (`loss_context` the one
    the parallel settings imply), the recipe's forward and `step_end` (or None), the runtime, the
    parallel config, the micro-batches per step, and for a pipeline the recipe's split
    (`PipelineSplit`) and a factory of the whole bare model on the meta device."""

    components: Components
    settings: StepSettings
    forward: Callable[[Any, Mapping[str, Any]], Any]
    step_end: Callable[[], Mapping[str, Any]] | None
    runtime: Any
    parallel: Any
    micro_batches: int
    pipeline: Any = None
    model_on_meta: Callable[[], Any] | None = None


@dataclass(frozen=True)
class LaidOut:
    """A layout's step `step_fn(state, batch)` and the evaluation's `forward` and `loss` (None: the
    evaluation hook's default, the components' loss)."""

    step_fn: Callable[[Any, Sequence[Mapping[str, Any]]], dict[str, Any]]
    forward: Callable[[Any, Mapping[str, Any]], Any]
    loss: Callable[[Any, Mapping[str, Any]], Any] | None


@dataclass(frozen=True)
class Layout:
    """One entry of the table: its name, whether the parallel settings ask for it, what it builds,
    and its rules (see the module docstring)."""

    name: str
    applies: Callable[[Any], bool]
    build: Callable[[StepInputs], LaidOut]
    check: Callable[[Any, Any, int], None]
    check_device: Callable[[Any], None]


def choose_layout(parallel: Any) -> Layout:
    """The layout `parallel` (the run's `ParallelConfig`) asks for: the first entry of `LAYOUTS` that applies."""
    return next(layout for layout in LAYOUTS if layout.applies(parallel))


# ----------------------------------------------------------------------------- the builders


def _build_plain(inputs: StepInputs) -> LaidOut:
    """The micro-batch step; evaluation runs the spec's forward, and its loss under the loss context
    when there is one (torch's loss_parallel() when the logits are split over the vocabulary)."""
    components = inputs.components
    step_fn = make_train_step(components.model, components.loss_fn, components.optimizers, components.schedulers,
                              settings=inputs.settings, grad_scaler=components.grad_scaler, forward=inputs.forward,
                              step_end=inputs.step_end)  # fmt: skip
    return LaidOut(step_fn, inputs.forward, _plain_eval_loss(components.loss_fn, inputs.settings.loss_context))


def _plain_eval_loss(loss_fn: Callable, context: Callable[[], contextlib.AbstractContextManager]) -> Callable | None:
    """The evaluation loss: None (the hook's default) without a loss context, else `loss_fn` inside it."""
    if context is contextlib.nullcontext:
        return None

    def eval_loss(output: Any, micro_batch: Mapping[str, Any]) -> Any:
        with context():
            return loss_fn(output, micro_batch)

    return eval_loss


def _pipeline_ties(inputs: StepInputs) -> list[dict[int, str]]:
    """The weights of the recipe's model tied across pipeline stages, found on a meta copy of it."""
    if inputs.parallel.pp_size == 1:
        return []
    return stage_ties(inputs.model_on_meta(), inputs.pipeline, inputs.parallel.pp_size)


def _build_pipeline(inputs: StepInputs) -> LaidOut:
    """A pipeline step over the step's micro-batches, adding the gradients of weights tied across
    stages; evaluation runs each micro-batch through the stages. No `step_end` (a ValueError)."""
    runtime, components, settings = inputs.runtime, inputs.components, inputs.settings
    if inputs.step_end is not None:
        raise ValueError(f"--parallel.pp-size {runtime.pp_size}: this recipe's step_end needs a pipeline-free step")
    layout = pipeline_layout(runtime, inputs.parallel, _pipeline_ties(inputs))
    step_fn = make_pipeline_step(components.model, components.loss_fn, components.optimizers, components.schedulers,
                                 layout, settings=settings, micro_batches=inputs.micro_batches)  # fmt: skip
    forward, loss = make_pipeline_eval(components.model, components.loss_fn, layout, settings.device,
                                       settings.loss_context)  # fmt: skip
    return LaidOut(step_fn, forward, loss)


def _build_context_parallel(inputs: StepInputs) -> LaidOut:
    """The spec's forward and loss split over the cp ranks (built once, for the step and evaluation);
    the step's loss context is the cp attention's."""
    components = inputs.components
    cp = context_parallel_parts(inputs.forward, components.loss_fn, mesh=context_parallel_mesh(inputs.runtime),
                                style=inputs.parallel.cp_style)  # fmt: skip
    settings = dataclasses.replace(inputs.settings, loss_context=cp.context)
    step_fn = make_train_step(components.model, cp.train_loss, components.optimizers, components.schedulers,
                              settings=settings, grad_scaler=components.grad_scaler, forward=cp.forward,
                              step_end=inputs.step_end)  # fmt: skip
    return LaidOut(step_fn, cp.forward, cp.eval_loss)


# ----------------------------------------------------------------------------- the rules


def check_tensor_parallel(config: Any, spec: Any, dp_size: int) -> None:
    """Tensor parallelism needs the recipe's tensor-parallel plan."""
    parallel = config.parallel
    if parallel.tp_size > 1 and spec.tensor_parallel is None:
        raise ConfigError(
            f"--parallel.tp-size {parallel.tp_size}: this recipe has no tensor-parallel plan for its model"
        )


def check_pipeline(config: Any, spec: Any, dp_size: int) -> None:
    """A pipeline needs the recipe's split (counted on a meta copy of the model) and, under 1F1B, a
    step's micro-batches to fill it."""
    parallel = config.parallel
    if parallel.pp_size == 1:
        return
    if spec.pipeline is None or spec.model_factory is None:
        raise ConfigError(f"--parallel.pp-size {parallel.pp_size}: this recipe has no pipeline split for its model")
    blocks = build_on_meta(lambda: spec.model_factory(config)).get_submodule(spec.pipeline.layers)
    stage_layers(len(blocks), parallel.pp_size)  # the split, counted on the meta device
    train = config.train
    micro_batches = train.global_batch_size // (train.micro_batch_size * dp_size)
    if parallel.pp_schedule == "1f1b" and micro_batches < parallel.pp_size:
        raise ConfigError(
            f"--parallel.pp-schedule 1f1b needs at least --parallel.pp-size ({parallel.pp_size}) micro-batches "
            f"per step, got {micro_batches} (--train.global-batch-size / (--train.micro-batch-size x {dp_size} "
            "data-parallel ranks)): lower --train.micro-batch-size or use --parallel.pp-schedule gpipe"
        )


def check_context_parallel(config: Any, spec: Any, dp_size: int = 0) -> None:
    """--parallel.cp-size > 1 needs a recipe whose attention can be split (`spec.attention_heads`), heads
    that divide by it, a data-parallel strategy (the cp ranks' gradients are summed) and none of the
    layouts it is not built for yet."""
    parallel = config.parallel
    if parallel.cp_size == 1:
        return
    cp = f"--parallel.cp-size {parallel.cp_size}"
    if spec.attention_heads is None:
        raise ConfigError(f"{cp}: this recipe's model has no context-parallel attention (use --parallel.cp-size 1)")
    heads = spec.attention_heads(config)
    if heads % parallel.cp_size:
        raise ConfigError(f"{cp} must divide the model's attention heads, got {heads}")
    if parallel.strategy == "none":
        raise ConfigError(
            f"{cp} needs --parallel.strategy ddp or fsdp2 (each cp rank's gradients cover only its slice "
            "of the sequence)"
        )
    others = (
        ("--parallel.tp-size", parallel.tp_size, 1), ("--parallel.pp-size", parallel.pp_size, 1),
        ("--parallel.replicate", parallel.replicate, 1),
        ("--parallel.activation-checkpointing", parallel.activation_checkpointing, False),
        ("--parallel.compile", parallel.compile, False),  # the attention's function mode is untested under dynamo
    )  # fmt: skip
    for flag, value, alone in others:
        if value != alone:
            raise ConfigError(f"{cp} cannot be combined with {flag} {value} yet")


def check_ring_device(config: Any) -> None:
    """--parallel.cp-style ring runs on CUDA or NPU only (torch's ring attention has no CPU kernel)."""
    if config.parallel.cp_size == 1 or config.parallel.cp_style != "ring":
        return
    device = resolve_device_type(config.runtime.device)
    if device not in ("cuda", "npu"):
        raise ConfigError(
            f"--parallel.cp-style ring needs a CUDA or NPU device (torch's ring attention has no {device} "
            "kernel): use --parallel.cp-style ulysses"
        )


def _checks(*checks: Callable[[Any, Any, int], None]) -> Callable[[Any, Any, int], None]:
    """One check running `checks` in order (the first broken rule is the one reported)."""

    def check(config: Any, spec: Any, dp_size: int) -> None:
        for one in checks:
            one(config, spec, dp_size)

    return check


def _no_device_check(config: Any) -> None:
    return None


# The sizes' own rules (a tp plan, a pipeline split) come first in every entry, so a combination the
# context-parallel layout refuses is reported only once each size is possible on its own.
LAYOUTS: tuple[Layout, ...] = (
    Layout("context-parallel", lambda parallel: parallel.cp_size > 1, _build_context_parallel,
           _checks(check_tensor_parallel, check_pipeline, check_context_parallel), check_ring_device),
    Layout("pipeline", lambda parallel: parallel.pp_size > 1, _build_pipeline,
           _checks(check_tensor_parallel, check_pipeline), _no_device_check),
    Layout("plain", lambda parallel: True, _build_plain, _checks(check_tensor_parallel), _no_device_check),
)  # fmt: skip
