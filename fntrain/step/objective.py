"""What a step minimises and how it calls the model, when that is more than a recipe's `loss`.

    Objective(forward, loss)        the step's two functions (`make_train_step` documents both)
    ObjectiveSpec(build, frozen_model)  a recipe's entry: how to build them once the model is built

A recipe's `RecipeSpec.objective` is the one place the run learns of an objective (preference tuning,
distillation: `fntrain.step.objectives`). `build(config, built)` runs once, after the model, the data
and the optimizer are built, on every rank; it may load a frozen model of its own (a DPO reference, a
KD teacher), sharded like the trained one, and closes over it. `frozen_model(config)` gives that frozen
model bare (the run builds it on the meta device), so `fntrain plan` counts its weights per rank.
`forward_only(config)` gives, bare, the model the objective runs forward only on every micro-batch (the
reference or teacher; for an adapter-off reference the policy itself), so the throughput's TFLOP/s and
MFU count that forward too; None when no forward runs beside the policy's (a precomputed reference).
`rows_per_sample`: the rows of the model's batch each sample becomes (a preference pair: chosen and
rejected, 2), so the plan's activations are those of the rows the model sees.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Objective", "ObjectiveSpec"]


@dataclass(frozen=True)
class Objective:
    """`forward(model, micro_batch) -> output` and `loss(output, micro_batch) -> loss | (loss, metrics)`:
    what the train step and the evaluation call (metrics: 0-d device tensors, e.g. "rewards/chosen")."""

    forward: Callable[[Any, Mapping[str, Any]], Any]
    loss: Callable[[Any, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class ObjectiveSpec:
    """A recipe's objective: `build(config, built) -> Objective`; when it loads a frozen model,
    `frozen_model(config)`, that model's bare module (for the plan's memory); when it runs a forward
    beside the policy's on every micro-batch, `forward_only(config)`, that model's bare module or None
    (for the FLOPs per token); `rows_per_sample`, the model's batch rows per sample (for the plan)."""

    build: Callable[[Any, Any], Objective]
    frozen_model: Callable[[Any], Any] | None = None
    forward_only: Callable[[Any], Any] | None = None
    rows_per_sample: int = 1
