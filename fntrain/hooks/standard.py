"""The standard hook list, built from small factories of the built run, in the dispatch order of [S27]:
memory, throughput, metrics, progress, evaluate, sample, gc, profiler, the spec's extra hooks (before the
checkpoint, so that it saves what they reached), checkpoint, and the hang watchdog last (its silence
covers every other hook's work).

`standard_hooks(HookInputs(...))` runs the factories of `STANDARD_FACTORIES` in order. A factory is
`f(inputs, wiring) -> Hook | None` (None: the hook is off for this run; a tuple for the extra hooks).
What hooks share is passed explicitly in one `Wiring`: the metrics log (the metrics hook and evaluation
write it, the progress bar reads its latest record), the throughput meter (its figures are a source of
the metrics hook), and the list itself (what each checkpoint saves the states of). Adding a hook to the
standard list is one factory and one entry in `STANDARD_FACTORIES`, here. The records (`HookInputs`,
`Wiring`, `EarlyHooks`) live in `fntrain.hooks.standard_inputs`, re-exported here.

A recipe's config is expected to carry the hook sections under these names (`memory`, `throughput`,
`metrics`, `progress`, `evaluate`, `sample` (optional), `gc`, `profiler`, `checkpoint`, `watchdog`) plus `run_dir` and
`log_every`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from fntrain.checkpoint import SaveTarget
from fntrain.checkpoint.layout import checkpoint_root
from fntrain.hooks.checkpoint import checkpoint_hook, saves_at_end
from fntrain.hooks.evaluate import EvalParts, evaluate_hook, make_eval_fn
from fntrain.hooks.gc import gc_hook
from fntrain.hooks.memory import MemoryConfig, check_memory_device, memory_hook
from fntrain.hooks.metrics import metrics_hook
from fntrain.hooks.metrics_log import metrics_log
from fntrain.hooks.profiler import ProfilerConfig, check_profiler_config, profiler_hook
from fntrain.hooks.progress import progress_hook, set_library_progress_bars
from fntrain.hooks.sample import sample_hook
from fntrain.hooks.standard_inputs import EarlyHooks, Factory, HookFactory, HookInputs, Wiring
from fntrain.hooks.throughput import throughput_meter
from fntrain.hooks.watchdog import watchdog_hook
from fntrain.loop import Hook
from fntrain.runtime import Runtime

log = logging.getLogger("fntrain.hooks.evaluate")

__all__ = [
    "EarlyHooks",
    "HookFactory",
    "HookInputs",
    "Wiring",
    "STANDARD_FACTORIES",
    "make_wiring",
    "wire_standard_hooks",
    "under_run_dir",
    "memory_config",
    "profiler_config",
    "check_early_hooks",
    "early_hooks",
    "standard_hooks",
]


def under_run_dir(run_dir: str | os.PathLike, path: str | None, default: str = "") -> str:
    """`path` resolved against `run_dir`: None/empty is `run_dir/default`, a relative path lies under
    `run_dir`, an absolute one (after `~` expansion) stays."""
    run_dir = os.path.expanduser(os.fspath(run_dir))
    if not path:
        return os.path.join(run_dir, default) if default else run_dir
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.join(run_dir, path)


def memory_config(config: Any) -> MemoryConfig:
    """`config.memory` with its save_path resolved under `config.run_dir`."""
    return dataclasses.replace(
        config.memory, save_path=under_run_dir(config.run_dir, config.memory.save_path)
    )


def profiler_config(config: Any) -> ProfilerConfig:
    """`config.profiler` with its output_path resolved under `config.run_dir` (None: the run dir)."""
    return dataclasses.replace(
        config.profiler, output_path=under_run_dir(config.run_dir, config.profiler.output_path)
    )


def check_early_hooks(config: Any, runtime: Runtime) -> None:
    """What building the memory and profiler hooks for `runtime` would refuse (a device without
    allocator history, a profiler backend or rank list this launch cannot have), checked without
    building them: the run's first phase does this with a stand-in runtime, before any device work."""
    memory = config.memory
    if memory.enable or memory.mem_info:
        check_memory_device(memory, runtime.device)
    check_profiler_config(profiler_config(config), runtime)


def early_hooks(config: Any, runtime: Runtime) -> EarlyHooks:
    """Build the memory and profiler hooks from the recipe config, paths resolved under run_dir."""
    return EarlyHooks(
        memory_hook(memory_config(config), runtime), profiler_hook(profiler_config(config), runtime)
    )


def _memory(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    config = inputs.config.memory
    if not (config.enable or config.mem_info):
        return None
    return inputs.early.memory if inputs.early else memory_hook(memory_config(inputs.config), inputs.runtime)


def _throughput(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    return wiring.throughput.hook if inputs.config.throughput.enabled else None


def _metrics(inputs: HookInputs, wiring: Wiring) -> Hook:
    """Never None: it also ends the metrics log (the trackers' summary) at TRAIN_END / ABORT."""
    sources = (wiring.throughput.figures,) if inputs.config.throughput.enabled else ()
    return metrics_hook(inputs.runtime, log_every=inputs.config.log_every, writer=wiring.writer,
                        sources=sources, last_step=inputs.plan.train_iters)  # fmt: skip


def _progress(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    config = inputs.config.progress
    if not config.enabled:
        set_library_progress_bars(False)  # progress off turns the other libraries' bars off too
        return None
    return progress_hook(config, inputs.runtime, total=inputs.plan.train_iters, latest=wiring.writer.latest)


def _evaluate(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    has_validation = inputs.val_dataset is not None and len(inputs.val_dataset) > 0
    config = inputs.config.evaluate.resolved(has_validation, inputs.plan.train_iters)
    components = inputs.components
    if not config.enabled or not has_validation:
        return None
    log.info("evaluating on %d validation samples %s (--evaluate.eval-every, --evaluate.at-end)",
             len(inputs.val_dataset), config.describe())  # fmt: skip
    eval_fn = make_eval_fn(
        components.model,
        inputs.eval_loss or components.loss_fn,
        inputs.val_dataset,
        micro_batch_size=config.micro_batch_size or inputs.eval_micro_batch_size,
        runtime=inputs.runtime,
        max_batches=config.max_batches,
        parts=EvalParts(collate_fn=inputs.collate_fn, forward=inputs.forward, autocast_dtype=inputs.autocast_dtype,
                        weighting=inputs.config.train.loss_weighting),  # fmt: skip
        group=inputs.dp_group,
    )
    if inputs.extra_eval is not None:
        eval_fn = _merged(eval_fn, inputs.extra_eval)
    return evaluate_hook(config, eval_fn, inputs.runtime, writer=wiring.writer,
                         last_step=inputs.plan.train_iters)  # fmt: skip


def _sample(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    """Samples every sample.every steps and at the end, with prompts and the recipe's sampler (the
    run's first phase refused samples asked of a recipe without one)."""
    config = getattr(inputs.config, "sample", None)
    if config is None or not config.enabled or inputs.sampler is None:
        return None
    return sample_hook(config, inputs.sampler, inputs.components.model, inputs.runtime, inputs.run_dir,
                       writer=wiring.writer, last_step=inputs.plan.train_iters)  # fmt: skip


def _gc(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    config = inputs.config.gc
    if not (config.gc_every or config.empty_cache_every or config.disable_automatic):
        return None
    return gc_hook(config, inputs.runtime)


def _profiler(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    if not inputs.config.profiler.enabled:
        return None
    if inputs.early:
        return inputs.early.profiler
    return profiler_hook(profiler_config(inputs.config), inputs.runtime)


def _extra(inputs: HookInputs, wiring: Wiring) -> tuple[Hook, ...]:
    """The spec's and the objective's hooks, a `HookFactory` built here over the run's wiring."""
    hooks = []
    for extra in inputs.extra:
        made = extra.make(inputs, wiring) if isinstance(extra, HookFactory) else extra
        hooks.extend(() if made is None else made if isinstance(made, tuple) else (made,))
    return tuple(hooks)


def _checkpoint(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    """Saves the state of every stateful hook of the list (itself included) and `run_config`, with the
    run directory and the validation loss of the step (the metrics log's, rank 0: the one that writes
    meta.json and deletes); handles the preemption signals itself (a preemption ends the run with
    outcome "preempted")."""
    config = inputs.config.checkpoint
    if not (config.enabled or config.save_on_interrupt or saves_at_end(config, inputs.restoring)):
        return None
    target = SaveTarget(checkpoint_root(config, inputs.run_dir), inputs.components, hooks=lambda: wiring.hooks,
                        config=inputs.run_config, recipe=inputs.recipe, data=inputs.data_fingerprint,
                        run_dir=inputs.run_dir, val_loss=_val_loss_at(wiring.writer))  # fmt: skip
    return checkpoint_hook(config, target, inputs.runtime, restoring=inputs.restoring)


def _val_loss_at(writer: Any) -> Callable[[int], float | None]:
    """step -> the val_loss the metrics log recorded at that step (None: no evaluation there)."""

    def at(step: int) -> float | None:
        last = writer.last_value("val_loss")
        return last[1] if last is not None and last[0] == step else None

    return at


def _watchdog(inputs: HookInputs, wiring: Wiring) -> Hook | None:
    config = inputs.config.watchdog
    return watchdog_hook(config, inputs.runtime, inputs.run_dir) if config.enabled else None


STANDARD_FACTORIES: tuple[Factory, ...] = (
    _memory, _throughput, _metrics, _progress, _evaluate, _sample, _gc, _profiler, _extra, _checkpoint,
    _watchdog,
)
"""The standard list, in dispatch order: one factory per hook."""


def make_wiring(inputs: HookInputs) -> Wiring:
    """The shared parts of the standard hooks of `inputs`, with an empty list (opens nothing)."""
    config, runtime = inputs.config, inputs.runtime
    return Wiring(
        writer=metrics_log(config.metrics, runtime, inputs.run_dir, attempt=inputs.attempt,
                           run_config=inputs.run_config),
        throughput=throughput_meter(config.throughput, runtime, flops_per_token=inputs.flops_per_token),
    )  # fmt: skip


def wire_standard_hooks(inputs: HookInputs) -> Wiring:
    """The standard hooks of the run `inputs` describes, with what they share: each factory of
    `STANDARD_FACTORIES` in order, those that return None left out (`.hooks`), and the metrics log the
    end of the run writes its summary to (`.writer`). Builds no file and opens nothing: the metrics log
    and the hooks open what they write at TRAIN_BEGIN or their first record."""
    wiring = make_wiring(inputs)
    for factory in STANDARD_FACTORIES:
        made = factory(inputs, wiring)
        if made is not None:
            wiring.hooks.extend(made if isinstance(made, tuple) else (made,))
    return wiring


def standard_hooks(inputs: HookInputs) -> list[Hook]:
    """The standard hook list of `wire_standard_hooks(inputs)`."""
    return wire_standard_hooks(inputs).hooks


def _merged(*eval_fns: Callable[[], Mapping[str, float]]) -> Callable[[], dict[str, float]]:
    """One evaluation function returning the metrics of all of `eval_fns`, called in order."""

    def evaluate() -> dict[str, float]:
        metrics: dict[str, float] = {}
        for eval_fn in eval_fns:
            metrics.update(eval_fn())
        return metrics

    return evaluate
