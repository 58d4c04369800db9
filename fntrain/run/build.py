"""Phase 2's build: the model, the data pipeline over what phase 1 read, the optimizer and schedule,
the step function and the standard hooks.

    build_job(config, spec, runtime, checked)     -> Built   model, data, optimizer, schedule [S1]
    train_step(built, spec)                       the step, wired to the runtime (pipeline or not)
    job_hooks(built, spec, early, attempt=...)    the standard hook list over what was built
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import default_collate

from fntrain.components import Components
from fntrain.context_parallel import context_parallel_parts
from fntrain.data.pipeline import build_data
from fntrain.hooks.standard import HookInputs, standard_hooks
from fntrain.hooks.throughput import measure_flops_per_token
from fntrain.loop import Hook
from fntrain.optim import build_lr_schedule, build_optimizer
from fntrain.pipeline_step import make_pipeline_eval, make_pipeline_step, pipeline_layout
from fntrain.run.checks import Checked, dataset_len, full_model_on_meta
from fntrain.run.config import Built, JobConfig, RecipeSpec
from fntrain.run.config_file import config_to_dict
from fntrain.run.recipes import recipe_reference
from fntrain.runtime.parallel import (
    autocast_dtype,
    build_grad_scaler,
    context_parallel_mesh,
    data_parallel_group,
    gradient_group_size,
    loss_context,
)
from fntrain.runtime.pipeline import stage_ties
from fntrain.step import make_train_step

__all__ = ["build_job", "train_step", "job_hooks"]


def build_job(config: JobConfig, spec: RecipeSpec, runtime: Any, checked: Checked) -> Built:
    """The model (built and parallelized by the recipe), then the data pipeline over the datasets phase
    1 read, the optimizer and the schedule [S1]. A loss with a `bind_model(model)` method gets the
    parallelized model once [S4]."""
    model = spec.build_model(config, runtime)
    if callable(getattr(spec.loss, "bind_model", None)):
        spec.loss.bind_model(model)
    inputs, plan, loader = checked.inputs, checked.plan, config.loader
    data = build_data(
        inputs.train_set, micro_batch_size=config.train.micro_batch_size, micro_batches=plan.micro_batches,
        collate_fn=inputs.collate_fn, shuffle=loader.shuffle, seed=config.seed, dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size, num_workers=loader.num_workers, prefetch=loader.prefetch,
        prefetch_depth=loader.prefetch_depth, pin_memory=loader.pin_memory and runtime.device.type != "cpu",
    )  # fmt: skip
    full_model = full_model_on_meta(config, spec) if config.parallel.pp_size > 1 else None
    optimizer = build_optimizer(config.optim, model, full_model=full_model).optimizer
    schedule = build_lr_schedule(config.schedule, plan, optimizer).scheduler
    components = Components(
        model=model, loss_fn=spec.loss, optimizers=(optimizer,), schedulers=(schedule,),
        grad_scaler=build_grad_scaler(config.parallel, runtime),
    )  # fmt: skip
    run_dir = Path(config.run_dir).expanduser()
    return Built(config, runtime, plan, components, inputs.assets, data, inputs.val_set, inputs.collate_fn, run_dir)


def _pipeline_ties(config: JobConfig, spec: RecipeSpec) -> list[dict[int, str]]:
    """The weights of the recipe's model tied across pipeline stages (none without a pipeline)."""
    if config.parallel.pp_size == 1:
        return []
    return stage_ties(full_model_on_meta(config, spec), spec.pipeline, config.parallel.pp_size)


def train_step(built: Built, spec: RecipeSpec) -> Any:
    """The step over the built components, wired to the runtime: its device, data-parallel size and
    group, the autocast dtype and loss context the parallel settings imply, the grad scaler. Under
    pipeline parallelism a pipeline step over the plan's micro-batches, adding the gradients of weights
    tied across stages."""
    config, runtime, components = built.config, built.runtime, built.components
    parallel, train = config.parallel, config.train
    common = dict(
        max_grad_norm=train.max_grad_norm, loss_weighting=train.loss_weighting, device=runtime.device,
        dp_size=gradient_group_size(runtime), dp_group=data_parallel_group(runtime),
        autocast_dtype=autocast_dtype(parallel), loss_context=loss_context(runtime, parallel),
    )  # fmt: skip
    step_end = spec.step_end(config, built) if spec.step_end is not None else None
    if runtime.cp_size > 1:
        cp = _context_parallel_parts(built, spec)
        return make_train_step(components.model, cp.train_loss, components.optimizers, components.schedulers,
                               grad_scaler=components.grad_scaler, forward=cp.forward, step_end=step_end,
                               **(common | {"loss_context": cp.context}))  # fmt: skip
    if runtime.pp_size > 1:
        if step_end is not None:
            raise ValueError(f"--parallel.pp-size {runtime.pp_size}: this recipe's step_end needs a pipeline-free step")
        layout = pipeline_layout(runtime, parallel, _pipeline_ties(config, spec))
        return make_pipeline_step(components.model, components.loss_fn, components.optimizers,
                                  components.schedulers, layout, micro_batches=built.plan.micro_batches,
                                  **common)  # fmt: skip
    return make_train_step(components.model, components.loss_fn, components.optimizers, components.schedulers,
                           grad_scaler=components.grad_scaler, forward=spec.forward, step_end=step_end,
                           **common)  # fmt: skip


def _context_parallel_parts(built: Built, spec: RecipeSpec) -> Any:
    """The spec's forward and loss split over the cp ranks (`fntrain.context_parallel`)."""
    return context_parallel_parts(spec.forward, built.components.loss_fn, mesh=context_parallel_mesh(built.runtime),
                                  style=built.config.parallel.cp_style)  # fmt: skip


def _sample_micro_batch(built: Built) -> Any:
    """One micro-batch of the training data (host tensors), for counting FLOPs per token."""
    dataset = built.data.dataset
    size = built.config.train.micro_batch_size
    if dataset_len(dataset) is None:
        samples = list(itertools.islice(iter(dataset), size))
    else:
        samples = [dataset[i] for i in range(min(size, len(dataset)))]
    return (built.collate_fn or default_collate)(samples)


def _flops_per_token(built: Built, spec: RecipeSpec) -> Callable[[], float] | None:
    """FLOPs per token, counted when the throughput hook first needs them (at TRAIN_BEGIN) on a meta
    copy of the bare model with a real micro-batch: no memory, no device work."""
    if spec.model_factory is None:
        return None

    def measure() -> float:
        return measure_flops_per_token(
            lambda: spec.model_factory(built.config), _sample_micro_batch(built), loss_fn=spec.loss,
            forward=spec.forward,
        )  # fmt: skip

    return measure


def _eval_functions(built: Built, spec: RecipeSpec) -> tuple[Callable, Callable | None]:
    """(forward, loss) for evaluation: the spec's, run through the pipeline stages under pipeline
    parallelism, the loss under torch's loss_parallel() when the logits are split over the vocabulary."""
    runtime, parallel = built.runtime, built.config.parallel
    context = loss_context(runtime, parallel)
    if runtime.cp_size > 1:
        cp = _context_parallel_parts(built, spec)
        return cp.forward, cp.eval_loss
    if runtime.pp_size > 1:
        layout = pipeline_layout(runtime, parallel)
        return make_pipeline_eval(built.components.model, built.components.loss_fn, layout, runtime.device, context)
    if context is contextlib.nullcontext:
        return spec.forward, None
    loss_fn = built.components.loss_fn

    def eval_loss(output: Any, micro_batch: Mapping[str, Any]) -> Any:
        with context():
            return loss_fn(output, micro_batch)

    return spec.forward, eval_loss


def job_hooks(built: Built, spec: RecipeSpec, early: Any = None, *, attempt: int = 0,
              last: Hook | None = None,
              data_fingerprint: dict[str, Any] | None = None) -> list[Hook]:  # fmt: skip
    """The standard hook list (memory, throughput, metrics, progress, evaluate, gc, profiler, the
    spec's extra hooks, checkpoint, watchdog), wired to what `build_job` made; `last` goes at the end;
    `data_fingerprint` goes into every checkpoint."""
    config = built.config
    eval_forward, eval_loss = _eval_functions(built, spec)
    hooks = standard_hooks(HookInputs(
        config,
        built.runtime,
        built.plan,
        built.components,
        run_dir=built.run_dir,
        early=early,
        val_dataset=built.val_dataset,
        eval_micro_batch_size=config.train.micro_batch_size,
        collate_fn=built.collate_fn,
        forward=eval_forward,
        eval_loss=eval_loss,
        autocast_dtype=autocast_dtype(config.parallel),
        dp_group=data_parallel_group(built.runtime),
        flops_per_token=_flops_per_token(built, spec),
        extra_eval=spec.eval_metrics(config, built) if spec.eval_metrics else None,
        run_config=config_to_dict(config),
        recipe=recipe_reference(spec),
        extra=list(spec.hooks(built)) if spec.hooks else (),
        attempt=attempt,
        data_fingerprint=data_fingerprint,
    ))
    return hooks + ([last] if last is not None else [])
