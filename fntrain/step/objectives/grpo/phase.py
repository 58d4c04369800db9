"""GRPO's phase of the step: the rollout before the loss, and what it keeps between steps and resumes.

    phase = rollout_phase(generate, restore, settings)   # generate(state, prompts, index) -> Generation
    phase.step(state, batch, train)      the objective's `rollout` (`fntrain.step.objective.RolloutStep`)
    phase.state_hook                     stateful hook "grpo": what a checkpoint keeps of the phase
    phase.count_batch(batch)             (tokens, rows) the last step trained on, for the throughput
    phase.take_samples()                 the last generation's sample completions, handed out once

Run step s trains on generation batch s // R, its optimizer step s % R (R = `RolloutSettings.steps`);
the loop's batch holds that generation's prompt rows at every one of its R steps (`RunPlan.steps_per_read`),
and only the first generates. What the phase keeps is one record, `RolloutMemory`: the generation being
trained on, the running count of tokens seen (TRL's `num_tokens`), the samples not yet published.

A checkpoint inside a generation batch keeps the batch itself (`generation_state`: this rank's rows,
their advantages and extra log-probs, as JSON numbers that round-trip exactly), so a resume neither
regenerates nor skips a rollout: the rerun trains on the very micro-batches it would have. At a batch's
edge nothing but the count is kept: the next generation is made from the key (seed, generation index).
A batch is split by rank, so it resumes on the same number of data-parallel ranks only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.runtime.device import synchronize
from fntrain.state import TrainState
from fntrain.stateful import StatefulHook, stateful
from fntrain.step.objectives.grpo.layout import Row, plan_rows, shuffled_rows
from fntrain.step.objectives.grpo.rollout import Generation, RolloutSettings, lay_out

__all__ = ["RolloutMemory", "RolloutPhase", "rollout_phase", "generation_state", "restore_generation"]

log = logging.getLogger("fntrain.step.objectives.grpo")

STATE_NAME = "grpo"
_LOGPS = ("old_logps", "ref_logps")


@dataclass
class RolloutMemory:
    """What the phase keeps between steps (mutable on purpose: the one record the phase threads)."""

    generation: Generation | None = None  # the batch being trained on; dropped after its last step
    saved: dict[str, Any] | None = None  # a restored batch, rebuilt from its prompts at the next step
    num_tokens: int = 0  # prompt and completion tokens of every generation batch so far
    samples: tuple[dict[str, Any], ...] = ()  # the last generation's samples, until taken
    counted: tuple[Any, int] = (0, 0)  # (tokens, rows) of the last step
    counts: tuple[tuple[Any, int], ...] = ()  # each optimizer step's (tokens, rows) of the generation


@dataclass(frozen=True)
class RolloutPhase:
    """The phase's parts (see the module docstring)."""

    step: Callable[[TrainState, Any, Callable[[TrainState, Sequence[Any]], dict[str, Any]]], dict[str, Any]]
    state_hook: StatefulHook
    count_batch: Callable[[Any], tuple[Any, int]]
    take_samples: Callable[[], tuple[dict[str, Any], ...]]
    memory: RolloutMemory = field(repr=False)


def rollout_phase(generate: Callable[[TrainState, Sequence[Any], int], Generation],
                  settings: RolloutSettings) -> RolloutPhase:  # fmt: skip
    """The phase over `generate(state, prompts, index)` (a bound `rollout`)."""
    memory = RolloutMemory()

    def step(state: TrainState, batch: Any, train: Callable[[TrainState, Sequence[Any]], dict[str, Any]]) -> dict[str, Any]:
        index, position = divmod(state.global_step, settings.steps)
        made = _current(memory, state, _prompts(batch), index, position, generate, settings)
        micro_batches = memory.generation.steps[position % settings.steps_per_pass]
        started = time.perf_counter()
        metrics = train(state, list(micro_batches))
        if made:
            synchronize(settings.device)  # times a generation step's optimizer step to its end
            metrics = _merged(metrics, {**memory.generation.metrics, "time/train_s": time.perf_counter() - started})
        metrics["num_tokens"] = memory.num_tokens
        memory.counted = memory.counts[position % settings.steps_per_pass]
        if position == settings.steps - 1:
            memory.generation = None  # its last step: nothing of it is needed again
        return metrics

    def take_samples() -> tuple[dict[str, Any], ...]:
        samples, memory.samples = memory.samples, ()
        return samples

    hook = stateful(STATE_NAME, _ignore, lambda: _state_dict(memory, settings),
                    lambda saved: _load_state_dict(memory, saved, settings))  # fmt: skip
    return RolloutPhase(step, hook, lambda batch: memory.counted, take_samples, memory)


def _ignore(event: Any, state: Any, info: Any) -> None:
    return None


def _prompts(batch: Any) -> Sequence[Any]:
    """The prompt rows of the loop's batch: its one micro-batch, a list of rows (`fntrain.data.prompts`)."""
    return batch[0] if len(batch) == 1 and isinstance(batch[0], (list, tuple)) else batch


def _current(memory: RolloutMemory, state: TrainState, prompts: Sequence[Any], index: int, position: int,
             generate: Callable[[TrainState, Sequence[Any], int], Generation], settings: RolloutSettings) -> bool:  # fmt: skip
    """Make generation batch `index` current: kept, restored from a checkpoint, or generated (True)."""
    if memory.generation is not None and memory.generation.index == index:
        return False
    saved, memory.saved = memory.saved, None
    if saved is not None and saved["index"] == index:
        memory.generation = restore_generation(saved, prompts, settings)
        memory.counts = _counts(memory.generation)
        return False
    if position:
        log.warning("step %d is step %d of generation batch %d, which the checkpoint did not keep: it is "
                    "generated again with the current weights", state.global_step + 1, position + 1, index)  # fmt: skip
    memory.generation = generate(state, prompts, index)
    memory.num_tokens += memory.generation.tokens
    memory.samples = memory.generation.samples
    memory.counts = _counts(memory.generation)
    return True


def _counts(generation: Generation) -> tuple[tuple[Any, int], ...]:
    """Each optimizer step's (tokens, rows) on this rank: what the throughput counts."""
    counts = []
    for step in generation.steps:
        tokens = sum(batch["attention_mask"].sum() for batch in step)
        counts.append((tokens, sum(batch["input_ids"].shape[0] for batch in step)))
    return tuple(counts)


def _merged(metrics: dict[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    if clash := sorted(set(more) & set(metrics)):
        raise ValueError(f"the rollout's metrics {clash} collide with the step's own")
    metrics.update(more)
    return metrics


# ----------------------------------------------------------------------------- the checkpointed state


def _state_dict(memory: RolloutMemory, settings: RolloutSettings) -> dict[str, Any]:
    generation = memory.generation
    saved = generation_state(generation, settings) if generation is not None else memory.saved
    return {"num_tokens": memory.num_tokens, "generation": saved}


def _load_state_dict(memory: RolloutMemory, saved: Mapping[str, Any], settings: RolloutSettings) -> None:
    memory.num_tokens = int(saved["num_tokens"])
    memory.generation, memory.saved = None, None
    generation = saved.get("generation")
    if generation is None:
        return
    if generation["dp_size"] != settings.dp_size:
        raise ValueError(
            f"the checkpoint was saved inside generation batch {generation['index']} on {generation['dp_size']} "
            f"data-parallel ranks, whose rows are split by rank: resume it on {generation['dp_size']} ranks, or "
            "from a checkpoint at a generation batch's edge"
        )
    unusable = _unusable(generation, settings)
    if unusable:
        log.warning("the checkpoint's generation batch %d %s: it is generated again", generation["index"],
                    unusable)  # fmt: skip
        return
    memory.saved = dict(generation)


def _unusable(generation: Mapping[str, Any], settings: RolloutSettings) -> str | None:
    """Why this run cannot train on the saved batch (settings changed under checkpoint.allow_changes), None
    when it can: another shape or group size (its rows would be laid out under other prompts), or no
    reference log-probs where grpo.beta is now > 0."""
    shape = {"rows_total": settings.rows, "steps": settings.steps, "micro_batch_size": settings.micro_batch_size,
             "num_generations": settings.grpo.num_generations}  # fmt: skip
    if any(generation.get(name) != value for name, value in shape.items()):
        return f"has another shape than this run's ({shape})"
    if settings.grpo.beta > 0 and any("ref_logps" not in row for row in generation["rows"].values()):
        return f"holds no reference log-probs (made with grpo.beta 0, this run has {settings.grpo.beta})"
    return None


def generation_state(generation: Generation, settings: RolloutSettings) -> dict[str, Any]:
    """This rank's part of `generation` as JSON data: each row's completion, whether it is trained, its
    advantage and its extra log-probs on its loss positions (float32 values: they round-trip exactly)."""
    rows: dict[str, Any] = {}
    for plan_step, step in zip(generation.plan.steps, generation.steps, strict=True):
        for micro, batch in zip(plan_step, step, strict=True):
            valid = batch["labels"][:, 1:] != IGNORE_INDEX
            for position, i in enumerate(micro):
                row = generation.rows[i]
                entry = {"completion": list(row.completion_ids), "trained": row.trained,
                         "advantage": float(batch["advantages"][position])}  # fmt: skip
                for key in _LOGPS:
                    if key in batch:
                        entry[key] = batch[key][position][valid[position]].tolist()
                rows[str(i)] = entry
    return {"index": generation.index, "dp_size": settings.dp_size, "rows_total": settings.rows,
            "rows": rows, "steps": settings.steps, "micro_batch_size": settings.micro_batch_size,
            "num_generations": settings.grpo.num_generations,
            "generation_tokens": float(generation.steps[0][0]["generation_tokens"]),
            "tokens": generation.tokens}  # fmt: skip


def restore_generation(saved: Mapping[str, Any], prompts: Sequence[Any], settings: RolloutSettings) -> Generation:
    """The generation batch `generation_state` saved, laid out again from its prompts: the same
    micro-batches, bit for bit (no metrics or samples: they were logged when it was made)."""
    group = settings.grpo.num_generations
    plan = plan_rows(shuffled_rows(settings.rows, settings.seed, saved["index"]), steps=settings.steps_per_pass,
                     micro_batches=settings.micro_batches, micro_batch_size=settings.micro_batch_size,
                     dp_rank=settings.dp_rank, dp_size=settings.dp_size)  # fmt: skip
    entries = {int(i): entry for i, entry in saved["rows"].items()}
    rows = {i: Row(tuple(prompts[i // group].prompt_ids), tuple(entries[i]["completion"]), entries[i]["trained"])
            for i in plan.rows}  # fmt: skip
    advantages = torch.zeros(settings.rows, dtype=torch.float32)
    for i in plan.rows:
        advantages[i] = entries[i]["advantage"]
    steps = lay_out(plan, rows, advantages, saved["generation_tokens"], settings)
    for plan_step, step in zip(plan.steps, steps, strict=True):
        for micro, batch in zip(plan_step, step, strict=True):
            valid = batch["labels"][:, 1:] != IGNORE_INDEX
            for key in _LOGPS:
                if key in entries[micro[0]]:
                    values = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
                    for position, i in enumerate(micro):
                        values[position][valid[position]] = torch.tensor(entries[i][key], dtype=torch.float32,
                                                                         device=valid.device)  # fmt: skip
                    batch[key] = values
    return Generation(saved["index"], plan, rows, steps, {}, (), tokens=saved["tokens"])
