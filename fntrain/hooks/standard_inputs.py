"""The records the standard hook list is built from and shares [S27]: `EarlyHooks` (the memory and
profiler hooks built before the model), `HookInputs` (the job config and the built run), `Wiring` (what
the hooks share: the metrics log, the throughput meter, the list itself), `Factory`, the type of one
entry of `STANDARD_FACTORIES`, and `HookFactory`, an extra hook built from them. Plain frozen records that build nothing; `fntrain.hooks.standard`, which
re-exports them, builds the list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fntrain.hooks.metrics_log import MetricsLog
from fntrain.hooks.sample import Sampler
from fntrain.hooks.throughput import ThroughputMeter
from fntrain.loop import Hook
from fntrain.runtime import Runtime
from fntrain.state import RunPlan
from fntrain.step.components import Components

__all__ = ["EarlyHooks", "HookInputs", "Wiring", "Factory", "HookFactory"]


@dataclass(frozen=True)
class EarlyHooks:
    """The memory and profiler hooks, built before the model: a device without allocator history or a
    bad profiler setting fails before any model or device work [S9]."""

    memory: Any
    profiler: Any


@dataclass(frozen=True)
class HookInputs:
    """What the standard hooks are built from: the job config and the built run."""

    config: Any  # the job config: the hook sections, run_dir, log_every
    runtime: Runtime
    plan: RunPlan
    components: Components
    run_dir: Path
    early: EarlyHooks | None = None  # the memory and profiler hooks built before the model (None: here)
    val_dataset: Any = None  # map-style validation split (None or empty: no evaluation)
    eval_micro_batch_size: int = 1  # when evaluate.micro_batch_size is 0
    collate_fn: Callable[[list[Any]], Any] | None = None
    forward: Callable[[Any, Any], Any] | None = None  # (model, micro-batch) -> output for evaluation
    eval_loss: Callable[[Any, Any], Any] | None = None  # evaluation's loss (None: the components' loss)
    autocast_dtype: Any = None
    dp_group: Any = None  # the group evaluation reduces over
    flops_per_token: Any = None  # a number or a callable measured at TRAIN_BEGIN (see throughput_meter)
    extra_eval: Callable[[], Mapping[str, float]] | None = None  # more metrics per evaluation (every rank)
    run_config: dict[str, Any] | None = None  # the resolved config: trackers and checkpoints get it
    recipe: str | None = None  # the name that loads the recipe again: checkpoints record it
    extra: Sequence[Any] = ()  # the spec's and the objective's hooks (or HookFactory records), before the checkpoint
    attempt: int = 0  # which launch of the run this is; tags each metrics record
    data_fingerprint: Mapping[str, Any] | None = None  # what the data was: every checkpoint records it
    restoring: bool = False  # the launch restores a checkpoint: its end is saved too (`saves_at_end`)
    sampler: Sampler | None = None  # the recipe's text sampler (None: no samples during training)


@dataclass(frozen=True)
class Wiring:
    """What the standard hooks share, built once per list and handed to every factory."""

    writer: MetricsLog  # the metrics records: the metrics hook and evaluation write, progress reads
    throughput: ThroughputMeter  # its figures go into the metrics hook's records
    hooks: list[Hook] = field(default_factory=list)  # the list as built: the checkpoint saves their states


Factory = Callable[[HookInputs, Wiring], "Hook | tuple[Hook, ...] | None"]


@dataclass(frozen=True)
class HookFactory:
    """An extra hook (a recipe's or an objective's) that needs what the standard hooks share, e.g. the
    metrics log: `make(inputs, wiring)` builds it where the extra hooks go (None: no hook this run)."""

    make: Factory
