"""The standard hook list a recipe composes, in the dispatch order of [S27]:
memory, throughput, metrics, progress, evaluate, gc, profiler, checkpoint (+ any extra hooks, before the
checkpoint so that it saves what they reached).

A recipe's config is expected to carry the hook sections under these names (`memory`, `throughput`,
`metrics`, `progress`, `evaluate`, `gc`, `profiler`, `checkpoint`) plus `run_dir` and `log_every`; this
module only wires them together, so each recipe keeps composing builders rather than re-deriving them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.components import Components
from fntrain.hooks.checkpoint import checkpoint_hook, checkpoint_root
from fntrain.hooks.evaluate import evaluate_hook, make_eval_fn
from fntrain.hooks.gc import gc_hook
from fntrain.hooks.memory import MemoryConfig, memory_hook
from fntrain.hooks.metrics import MetricBoard, metrics_hook, metrics_log
from fntrain.hooks.profiler import ProfilerConfig, profiler_hook
from fntrain.hooks.progress import progress_hook
from fntrain.hooks.throughput import throughput_hook
from fntrain.hooks.watchdog import watchdog_hook
from fntrain.runtime import Runtime
from fntrain.state import RunPlan, TrainState

__all__ = [
    "EarlyHooks",
    "under_run_dir",
    "memory_config",
    "profiler_config",
    "early_hooks",
    "standard_hooks",
    "restore_run",
]


def under_run_dir(run_dir: str | os.PathLike, path: str | None, default: str = "") -> str:
    """`path` resolved against `run_dir`: None/empty is `run_dir/default`, a relative path lies under
    `run_dir`, an absolute one (after `~` expansion) stays."""
    run_dir = os.path.expanduser(os.fspath(run_dir))
    if not path:
        return os.path.join(run_dir, default) if default else run_dir
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.join(run_dir, path)


@dataclass(frozen=True)
class EarlyHooks:
    """The memory and profiler hooks, built before the model: a device without allocator history or a
    bad profiler setting fails before any model or device work [S9]."""

    memory: Any
    profiler: Any


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


def early_hooks(config: Any, runtime: Runtime) -> EarlyHooks:
    """Build the memory and profiler hooks from the recipe config, paths resolved under run_dir."""
    return EarlyHooks(
        memory_hook(memory_config(config), runtime), profiler_hook(profiler_config(config), runtime)
    )


def standard_hooks(
    config: Any,
    runtime: Runtime,
    plan: RunPlan,
    components: Components,
    *,
    run_dir: Path,
    early: EarlyHooks | None = None,
    val_dataset: Any = None,
    eval_micro_batch_size: int = 1,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    autocast_dtype: Any = None,
    dp_group: Any = None,
    flops_per_token: Any = None,
    run_config: dict[str, Any] | None = None,
    forward: Callable[[Any, Any], Any] | None = None,
    eval_loss: Callable[[Any, Any], Any] | None = None,
    extra_eval: Callable[[], Mapping[str, float]] | None = None,
    extra: Sequence[Any] = (),
    attempt: int = 0,
) -> list[Any]:
    """The hook list in [S27] order, then the hang watchdog. Throughput, metrics and progress share
    `log_every` and one `MetricBoard`; evaluation writes through the same metrics log; the checkpoint hook
    saves the state of every stateful hook in the returned list (itself included) and `run_config`, and
    handles the preemption signals itself (a preemption ends the run with outcome "preempted"); the
    watchdog goes last so that its silence covers every other hook's work (saves, evaluation). `forward`
    (model, micro-batch) -> output is the recipe's forward, used by evaluation too (None: the default),
    and `eval_loss` the loss evaluation uses (None: the components' loss); `extra_eval()` adds metrics to each evaluation (called on every rank). `extra` hooks go just before
    the checkpoint hook. `attempt` (which launch of the run this is) tags each metrics record."""
    early = early or early_hooks(config, runtime)
    last = plan.train_iters
    board = MetricBoard()
    writer = metrics_log(config.metrics, runtime, run_dir, attempt=attempt, run_config=run_config)
    hooks: list[Any] = [
        early.memory,
        throughput_hook(
            config.throughput, runtime, log_every=config.log_every, board=board, last_step=last,
            flops_per_token=flops_per_token,
        ),
        metrics_hook(runtime, log_every=config.log_every, writer=writer, board=board, last_step=last),
        progress_hook(config.progress, runtime, total=last, board=board, log_every=config.log_every),
    ]  # fmt: skip
    if config.evaluate.enabled and val_dataset is not None and len(val_dataset) > 0:
        eval_fn = make_eval_fn(
            components.model,
            eval_loss or components.loss_fn,
            val_dataset,
            micro_batch_size=config.evaluate.micro_batch_size or eval_micro_batch_size,
            runtime=runtime,
            collate_fn=collate_fn,
            forward=forward,
            max_batches=config.evaluate.max_batches,
            autocast_dtype=autocast_dtype,
            group=dp_group,
        )
        if extra_eval is not None:
            eval_fn = _merged(eval_fn, extra_eval)
        hooks.append(evaluate_hook(config.evaluate, eval_fn, runtime, writer=writer, last_step=last))
    hooks.append(gc_hook(config.gc, runtime))
    hooks.append(early.profiler)
    hooks.extend(extra)
    hooks.append(
        checkpoint_hook(
            config.checkpoint,
            components,
            runtime,
            directory=checkpoint_root(config.checkpoint, run_dir),
            hooks=lambda: hooks,  # every stateful hook's state goes into each checkpoint
            run_config=run_config,
        )
    )
    hooks.append(watchdog_hook(config.watchdog, runtime, run_dir))
    return hooks


def _merged(*eval_fns: Callable[[], Mapping[str, float]]) -> Callable[[], dict[str, float]]:
    """One evaluation function returning the metrics of all of `eval_fns`, called in order."""

    def evaluate() -> dict[str, float]:
        metrics: dict[str, float] = {}
        for eval_fn in eval_fns:
            metrics.update(eval_fn())
        return metrics

    return evaluate


def restore_run(
    config: Any, components: Components, runtime: Runtime, run_dir: Path, hooks: list[Any]
) -> TrainState:
    """Restore `config.checkpoint.restore_from` (none | latest | a path) into the components and the
    hooks' states [S36]; return the TrainState to train from."""
    from fntrain.checkpoint import restore

    checkpoint = config.checkpoint
    return restore(
        checkpoint.restore_from,
        components,
        root=checkpoint_root(checkpoint, run_dir),
        hooks=hooks,
        weights_only=checkpoint.weights_only,
        device=runtime.device,
        model_part=runtime.pp_size > 1,
    )
