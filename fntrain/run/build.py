"""Phase 2's build, entered once: `assemble(...)` -> `Assembled`, in this order:

    build_job(config, spec, runtime, checked)     -> Built   model, data, optimizer, schedule [S1]
    write_config, describe_start                  config.json and the start-of-run lines (rank 0)
    build_step(built, spec)                       the layout's step and evaluation, the layout chosen once
    job_hooks(built, spec, step, checked, opened)  the standard hook list over what was built
    the recipe's export, bound to the config      what the end of the run writes
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from fntrain.data.pipeline import build_data
from fntrain.data.settings import Batching
from fntrain.hooks.standard import HookInputs, Wiring, wire_standard_hooks
from fntrain.models.flops import measure_flops_per_token
from fntrain.run.checks import Checked, dataset_len, full_model_on_meta, generation_shape
from fntrain.run.config import Built, JobConfig, RecipeSpec
from fntrain.run.open import OpenedRun
from fntrain.run.report import describe_start
from fntrain.run.resolved import recipe_reference, recorded_config, write_config
from fntrain.runtime.groups import data_parallel_group, gradient_group_size
from fntrain.runtime.precision import autocast_dtype, build_grad_scaler, loss_context
from fntrain.step import StepSettings
from fntrain.step.components import Components
from fntrain.step.layouts import LaidOut, StepInputs, choose_layout
from fntrain.step.objective import with_rollout
from fntrain.step.optim import build_lr_schedule, build_optimizer

__all__ = ["Assembled", "assemble", "build_job", "build_step", "job_hooks"]

log = logging.getLogger("fntrain.run.build")


@dataclass(frozen=True)
class Assembled:
    """What phase 2 builds: the built parts, the layout's step and evaluation, the hooks with the
    metrics log they write, and the recipe's export bound to its config (None: the recipe has none)."""

    built: Built
    step: LaidOut
    wiring: Wiring
    export: Callable[[Built, Any], Any] | None


def assemble(config: JobConfig, spec: RecipeSpec, runtime: Any, checked: Checked, opened: OpenedRun,
             early: Any = None) -> Assembled:  # fmt: skip
    """Build the run (see the module docstring): everything later phases need of the recipe's spec is
    in the returned record, so nothing after this reads the spec."""
    built = build_job(config, spec, runtime, checked)
    if runtime.is_main:
        write_config(config, built.run_dir)
        for line in describe_start(built):  # parameters, world, plan: what is about to run
            log.info("%s", line)
    step = build_step(built, spec)
    wiring = job_hooks(built, spec, step, checked, opened, early)
    export = functools.partial(spec.export, config) if spec.export is not None else None
    return Assembled(built, step, wiring, export)


def build_job(config: JobConfig, spec: RecipeSpec, runtime: Any, checked: Checked) -> Built:
    """The model (built and parallelized by the recipe), then the data pipeline over the datasets phase
    1 read, the optimizer and the schedule [S1]. A loss with a `bind_model(model)` method gets the
    parallelized model once [S4]. A recipe's objective (`spec.objective`) is built last, over all of
    that: its forward and loss replace the spec's in the components."""
    model = spec.build_model(config, runtime)
    if callable(getattr(spec.loss, "bind_model", None)):
        spec.loss.bind_model(model)
    inputs, plan = checked.inputs, checked.plan
    batching = _batching(config, spec, runtime, plan)
    pin = config.loader.pin_memory and runtime.device.type != "cpu"  # pinned memory speeds accelerator copies only
    loader = dataclasses.replace(config.loader, pin_memory=pin)
    data = build_data(inputs.train_set, batching, loader, collate_fn=inputs.collate_fn)
    full_model = full_model_on_meta(config, spec) if config.parallel.pp_size > 1 else None
    optimizer = build_optimizer(config.optim, model, full_model=full_model).optimizer
    schedule = build_lr_schedule(config.schedule, plan, optimizer).scheduler
    components = Components(
        model=model, loss_fn=spec.loss, optimizers=(optimizer,), schedulers=(schedule,),
        grad_scaler=build_grad_scaler(config.parallel, runtime), forward=spec.forward,
    )  # fmt: skip
    run_dir = Path(config.run_dir).expanduser()
    built = Built(config, runtime, plan, components, inputs.assets, data, inputs.val_set, inputs.collate_fn, run_dir)
    if spec.objective is None:
        return built
    objective = spec.objective.build(config, built)  # may load its frozen model: after the trained one
    components = dataclasses.replace(components, loss_fn=objective.loss, forward=objective.forward)
    return dataclasses.replace(built, components=components, objective=objective)


def _batching(config: JobConfig, spec: RecipeSpec, runtime: Any, plan: Any) -> Batching:
    """What this rank reads per step: its share of each global batch, or, for a generating objective,
    the whole generation batch of prompts (every rank the same rows, read once per `steps_per_read`)."""
    generation = generation_shape(config, spec, runtime.dp_size)
    if generation is not None:
        return Batching(generation.prompts, 1, seed=config.seed, dp_rank=0, dp_size=1)
    return Batching(config.train.micro_batch_size, plan.micro_batches, seed=config.seed,
                    dp_rank=runtime.dp_rank, dp_size=runtime.dp_size)  # fmt: skip


def build_step(built: Built, spec: RecipeSpec) -> LaidOut:
    """The run's layout, looked up once from the parallel settings (`fntrain.step.layouts`), built over
    the components: the train step and the evaluation's forward and loss. The step is wired to the
    runtime: its device, gradient-averaging size and group, the autocast dtype and loss context the
    parallel settings imply, the grad scaler and the recipe's `step_end`; an objective's rollout phase
    runs before it (`with_rollout`)."""
    config, runtime = built.config, built.runtime
    parallel, train = config.parallel, config.train
    settings = StepSettings(
        max_grad_norm=train.max_grad_norm, loss_weighting=train.loss_weighting, device=runtime.device,
        dp_size=gradient_group_size(runtime), dp_group=data_parallel_group(runtime),
        autocast_dtype=autocast_dtype(parallel), loss_context=loss_context(runtime, parallel),
    )  # fmt: skip
    inputs = StepInputs(
        built.components, settings, built.components.forward, spec.step_end(config, built) if spec.step_end is not None else None,
        runtime, parallel, built.plan.micro_batches, pipeline=spec.pipeline,
        model_on_meta=lambda: full_model_on_meta(config, spec),
    )  # fmt: skip
    laid_out = choose_layout(parallel).build(inputs)
    rollout = built.objective.rollout if built.objective is not None else None
    return dataclasses.replace(laid_out, step_fn=with_rollout(rollout, laid_out.step_fn))


def _sample_micro_batch(built: Built) -> Any:
    """One micro-batch of the training data (host tensors), for counting FLOPs per token."""
    dataset = built.data.dataset
    size = built.config.train.micro_batch_size
    if dataset_len(dataset) is None:
        samples = list(itertools.islice(iter(dataset), size))
    else:
        samples = [dataset[i] for i in range(min(size, len(dataset)))]
    return (built.collate_fn or default_collate)(samples)


def _flops_per_token(built: Built, spec: RecipeSpec) -> Callable[[], float | None] | None:
    """FLOPs per token, counted when the throughput hook first needs them (at TRAIN_BEGIN) on a meta
    copy of the bare model with a real micro-batch: no memory, no device work. An objective's
    forward-only model (a reference, a teacher) adds its forward's FLOPs: the device does that work too."""
    if spec.model_factory is None:
        return None
    forward_only = spec.objective.forward_only if spec.objective is not None else None

    def measure() -> float | None:
        sample = _sample_micro_batch(built)
        if not isinstance(sample, Mapping):  # a generating objective's prompt rows: no model inputs to count on
            return None
        flops = measure_flops_per_token(lambda: spec.model_factory(built.config), sample, loss_fn=spec.loss,
                                        forward=spec.forward)  # fmt: skip
        if forward_only is not None:
            with torch.device("meta"):  # built without weights, as the plan builds it
                frozen = forward_only(built.config)
            if frozen is not None:
                flops += measure_flops_per_token(frozen, sample, forward=spec.forward, backward=False)
        return flops

    return measure


def job_hooks(built: Built, spec: RecipeSpec, step: LaidOut, checked: Checked, opened: OpenedRun,
              early: Any = None) -> Wiring:  # fmt: skip
    """The standard hook list (memory, throughput, metrics, progress, evaluate, gc, profiler, the
    spec's extra hooks, checkpoint, watchdog), wired to what `build_job` made, with the metrics log
    they write (`Wiring`). From phase 1 (`checked`): the data fingerprint every checkpoint records and
    whether the launch restores (its end is then saved); from the opened run: which attempt this is,
    and its progress hook, last in the list."""
    config = built.config
    wiring = wire_standard_hooks(HookInputs(
        config,
        built.runtime,
        built.plan,
        built.components,
        run_dir=built.run_dir,
        early=early,
        val_dataset=built.val_dataset,
        eval_micro_batch_size=config.train.micro_batch_size,
        collate_fn=built.collate_fn,
        forward=step.forward,
        eval_loss=step.loss,
        autocast_dtype=autocast_dtype(config.parallel),
        dp_group=data_parallel_group(built.runtime),
        flops_per_token=_flops_per_token(built, spec),
        extra_eval=spec.eval_metrics(config, built) if spec.eval_metrics else None,
        run_config=recorded_config(config),
        recipe=recipe_reference(spec.config),
        extra=[*(spec.hooks(built) if spec.hooks else ()), *(built.objective.hooks if built.objective else ())],
        attempt=opened.attempt,
        data_fingerprint=checked.fingerprint,
        restoring=checked.launch.resumes,
        sampler=spec.sampler(config, built) if spec.sampler else None,
    ))
    return dataclasses.replace(wiring, hooks=[*wiring.hooks, opened.progress])
