"""What a step minimises and how it calls the model, when that is more than a recipe's `loss`: an
objective, named by a recipe in one entry.

    ObjectiveSpec(name, build, ...)   a recipe's entry: its rules, the layouts it runs on, how it reads
                                      its data, what the plan shows, and how to build it
    Objective(forward, loss, ...)     what `build` returns: the step's two functions, an optional rollout
                                      phase before them, and the hooks that keep its state
    check_parallel, check_objective   the entry's rules, in the run's first phase (and `fntrain plan`)

A recipe's `RecipeSpec.objective` is the one place the run learns of an objective (preference tuning,
distillation, GRPO: `fntrain.step.objectives`); the run has no branch per objective. `build(config,
built)` runs once, after the model, the data and the optimizer are built, on every rank; it may load a
frozen model of its own (a DPO reference, a KD teacher), sharded like the trained one, and closes over it.

- `check(config, dp_size)`: the rules across config sections (a loss that needs mean weighting, a
  reference that needs LoRA, a batch that must hold whole groups of completions), before any file,
  model or device work; each a `ValueError` naming the field.
- `parallel`: the model-parallel sizes beyond data parallelism (none, ddp, fsdp2) the objective runs
  under, among "tp", "pp", "cp" and "ep"; any other size > 1 is refused by `check_parallel`.
- `generation(config, dp_size)`: a generating objective reads prompts, not batches: a
  `GenerationShape` (how many prompt rows one generation batch reads, every rank the same rows, and how
  many optimizer steps it serves). The run plans and reads its data that way; None: the usual batches.
- `frozen_model(config)`: the frozen model it loads, bare (the plan counts its weights per rank);
  `forward_only(config)`: the model run forward only beside the policy on every micro-batch (the
  throughput's FLOPs count it); `rows_per_sample`: the model's batch rows per sample (a preference pair
  is 2) for the plan's activations; `plan(config, dp_size)`: more lines for the plan printout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fntrain.config import ConfigError
from fntrain.state import GenerationShape

__all__ = ["Objective", "ObjectiveSpec", "GenerationShape", "RolloutStep", "PARALLEL_SIZES", "check_parallel",
           "check_objective", "with_rollout"]  # fmt: skip

PARALLEL_SIZES = {"tp": "tp_size", "pp": "pp_size", "cp": "cp_size", "ep": "ep_size"}
"""The model-parallel dimensions an objective may name in `ObjectiveSpec.parallel`, and their settings."""

RolloutStep = Callable[[Any, Any, Callable[[Any, Sequence[Any]], dict[str, Any]]], dict[str, Any]]
"""`rollout(state, batch, train) -> metrics`: makes the step's micro-batches from the loop's batch by
running the policy (generation, scoring, extra log-prob forwards), calls `train(state, micro_batches)`
(the layout's optimizer step) and returns its metrics with the rollout's own."""


@dataclass(frozen=True)
class Objective:
    """`forward(model, micro_batch) -> output` and `loss(output, micro_batch) -> loss | (loss, metrics)`:
    what the train step and the evaluation call (metrics: 0-d device tensors, e.g. "rewards/chosen").
    `rollout`: a phase before them that makes the step's micro-batches (`RolloutStep`; None: the loop's
    batch is trained on as it is). `hooks`: hooks the run lists before the checkpoint hook, e.g. the
    objective's state as a stateful hook (checkpointed and restored like a hook's) or factories of
    hooks that need the run's wiring (`fntrain.hooks.standard_inputs.HookFactory`). `count_batch`: the
    (tokens, samples) a step trained on, for the throughput, when the loop's batch is not what it
    trained on (a rollout's rows, not the prompts it read); None: counted from the loop's batch."""

    forward: Callable[[Any, Mapping[str, Any]], Any]
    loss: Callable[[Any, Mapping[str, Any]], Any]
    rollout: RolloutStep | None = None
    hooks: tuple[Any, ...] = ()
    count_batch: Callable[[Any], tuple[Any, int]] | None = None


@dataclass(frozen=True)
class ObjectiveSpec:
    """A recipe's objective, one entry (the module docstring says what each part is for)."""

    name: str
    build: Callable[[Any, Any], Objective]
    check: Callable[[Any, int], None] | None = None
    parallel: tuple[str, ...] = ()
    generation: Callable[[Any, int], GenerationShape] | None = None
    frozen_model: Callable[[Any], Any] | None = None
    forward_only: Callable[[Any], Any] | None = None
    rows_per_sample: int = 1
    plan: Callable[[Any, int], Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parallel) - set(PARALLEL_SIZES))
        if unknown:
            raise ValueError(f"ObjectiveSpec.parallel names {unknown}; it may name {sorted(PARALLEL_SIZES)}")


def check_parallel(config: Any, objective: ObjectiveSpec | None) -> None:
    """A model-parallel size > 1 the objective does not run under: a `ConfigError` naming the flag (the
    first of the run's checks after the config's own, so it is said before what that size would need)."""
    if objective is None:
        return
    for dimension, name in PARALLEL_SIZES.items():
        size = getattr(config.parallel, name)
        if size != 1 and dimension not in objective.parallel:
            layouts = ["one process", "ddp", "fsdp2", *sorted(objective.parallel)]
            allowed = ", ".join(layouts[:-1]) + " and " + layouts[-1]
            raise ConfigError(f"--parallel.{name.replace('_', '-')} {size}: {objective.name} runs on {allowed} "
                              "only")  # fmt: skip


def check_objective(config: Any, objective: ObjectiveSpec | None, dp_size: int) -> None:
    """The objective's own rules (`ObjectiveSpec.check`) for `dp_size` data-parallel ranks, each a
    `ConfigError` naming the field."""
    if objective is None or objective.check is None:
        return
    try:
        objective.check(config, dp_size)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from error


def with_rollout(
    rollout: RolloutStep | None, step_fn: Callable[[Any, Sequence[Any]], dict[str, Any]]
) -> Callable[[Any, Any], dict[str, Any]]:
    """The layout's `step_fn` behind the objective's rollout phase (unchanged when it has none)."""
    if rollout is None:
        return step_fn

    def step(state: Any, batch: Any) -> dict[str, Any]:
        return rollout(state, batch, step_fn)

    return step
