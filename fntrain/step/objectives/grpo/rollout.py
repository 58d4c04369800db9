"""The rollout: a generation batch of prompts in, the micro-batches GRPO's loss trains on out.

    generation = rollout(prompts, index, parts, settings)

In order, on every rank (each makes only its own rows, `fntrain.step.objectives.grpo.layout`):
1. sample: each row's completion from its own generator, seeded by (seed, generation index, the
   prompt's dataset index, the sample's index), so its tokens do not depend on batch mates, world size
   or layout (`fntrain.sampling`);
2. score: the reward functions on this rank's rows, then one all_reduce makes every row's rewards,
   lengths and truncation flags known on every rank;
3. advantages over each prompt's group (`fntrain.step.objectives.grpo.advantages`), the same on every
   rank; the rows laid out as micro-batches;
4. extra log-prob forwards: the policy's own ("old_logps") only when the batch serves several optimizer
   steps (else the loss's ratio is exactly 1), the reference's ("ref_logps") only when beta > 0;
5. the metrics TRL logs for a generation and a few sample completions with their rewards.

The model-side parts (the policy, its log-prob forward, the reference, the tokenizer's decode, the
reward functions, the collectives) come in `RolloutParts`; the numbers in `RolloutSettings`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.runtime.device import synchronize
from fntrain.sampling import SampleSettings, decode, row_generator
from fntrain.step.objectives.grpo.advantages import group_advantages
from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.layout import Row, RowPlan, micro_batch, plan_rows, shuffled_rows
from fntrain.step.objectives.grpo.loss import AllReduce
from fntrain.step.objectives.grpo.rewards import score_completions
from fntrain.step.objectives.grpo.table import gather_rows, logged_means

__all__ = ["RolloutSettings", "RolloutParts", "Generation", "rollout", "lay_out", "completion_value"]

@dataclass(frozen=True)
class RolloutSettings:
    """The rollout's numbers: GRPO's settings, the run's seed and batch shape over the ranks, the
    tokenizer's pad and EOS ids, the device and the autocast dtype of the run's forwards."""

    grpo: GRPOConfig
    seed: int
    micro_batch_size: int
    micro_batches: int
    dp_rank: int = 0
    dp_size: int = 1
    pad_id: int = 0
    eos_ids: tuple[int, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    autocast_dtype: torch.dtype | None = None

    @property
    def steps_per_generation(self) -> int:
        """Micro-batch steps per rank one generation batch feeds (TRL's steps_per_generation)."""
        return self.grpo.steps_per_generation or self.micro_batches

    @property
    def steps_per_pass(self) -> int:
        """Optimizer steps of one pass over a generation batch."""
        return self.steps_per_generation // self.micro_batches

    @property
    def steps(self) -> int:
        """Optimizer steps a generation batch serves: its passes (num_iterations) of `steps_per_pass`."""
        return self.steps_per_pass * self.grpo.num_iterations

    @property
    def rows(self) -> int:
        """Completions in a generation batch, over all ranks."""
        return self.steps_per_generation * self.micro_batch_size * self.dp_size

    @property
    def prompts(self) -> int:
        """Prompts in a generation batch."""
        return self.rows // self.grpo.num_generations


@dataclass(frozen=True)
class RolloutParts:
    """What the rollout runs: `policy` (unwrapped from DDP; its mode is restored after generating),
    `policy_logps(model, micro_batch)` and `reference_logps(model, micro_batch)` (None when beta is 0):
    per-token log-probs [B, T-1] of the micro-batch's labels, without gradient; `decode_text(ids)`: a
    completion's text; the reward functions; `all_reduce(tensor, op)` and `gather_objects(items) -> every
    rank's items, in rank order` over the data-parallel ranks (None: one process); `keep_going` for the
    sampler (sharded weights: every rank decodes the same steps)."""

    policy: torch.nn.Module
    policy_logps: Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor]
    reference_logps: Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor] | None
    decode_text: Callable[[Sequence[int]], str]
    reward_functions: tuple[Any, ...]
    all_reduce: AllReduce | None = None
    keep_going: Callable[[bool], bool] | None = None
    gather_objects: Callable[[list[Any]], list[list[Any]]] | None = None


@dataclass(frozen=True)
class Generation:
    """One generation batch as this rank trains on it: its `index`, the rank's `plan` and `rows`, the
    micro-batches `steps[k][m]` of each optimizer step k of a pass, the generation's `metrics` (global,
    the same on every rank), a few `samples` (the batch's first rows, with their rewards) and `tokens`,
    the prompt and completion tokens of the whole batch."""

    index: int
    plan: RowPlan
    rows: Mapping[int, Row]
    steps: tuple[tuple[dict[str, torch.Tensor], ...], ...]
    metrics: dict[str, Any]
    samples: tuple[dict[str, Any], ...] = ()
    tokens: int = 0


def rollout(prompts: Sequence[Any], index: int, parts: RolloutParts, settings: RolloutSettings,
            trainer_state: Any = None) -> Generation:  # fmt: skip
    """Generation batch `index` over `prompts` (the batch's prompt rows, `fntrain.data.prompts`): sample,
    score, advantages, extra log-probs, metrics (see the module docstring). Times are host seconds,
    measured to the device's completion (one synchronize per phase, on generation steps only)."""
    _check_prompts(prompts, settings)
    started = time.perf_counter()
    plan = plan_rows(shuffled_rows(settings.rows, settings.seed, index), steps=settings.steps_per_pass,
                     micro_batches=settings.micro_batches, micro_batch_size=settings.micro_batch_size,
                     dp_rank=settings.dp_rank, dp_size=settings.dp_size)  # fmt: skip
    sampled = _sample(prompts, plan.rows, index, parts, settings)
    generated = _clock(settings.device)
    rewards, extras = _score(prompts, sampled, parts, settings, trainer_state)
    table = gather_rows(rewards, sampled, prompts, settings, parts.all_reduce)
    advantages = group_advantages(table.rewards, torch.tensor(settings.grpo.weights), settings.grpo.num_generations,
                                  settings.grpo.scale_rewards, settings.grpo.multi_objective_aggregation,
                                  names=[function.name for function in parts.reward_functions])  # fmt: skip
    rows = {i: Row(tuple(prompts[i // settings.grpo.num_generations].prompt_ids), tuple(sampled[i][0]),
                   trained=not (sampled[i][1] and settings.grpo.mask_truncated_completions)) for i in plan.rows}  # fmt: skip
    steps = lay_out(plan, rows, advantages.advantages, table.loss_tokens(settings.grpo), settings)
    scored = _clock(settings.device)
    _extra_logps(steps, parts, settings)
    done = _clock(settings.device)
    metrics = {**table.metrics(), **advantages.metrics, **logged_means(extras.metrics, parts.all_reduce, settings.device),
               "time/generation_s": generated - started, "time/rewards_s": scored - generated,
               "time/logprobs_s": done - scored}  # fmt: skip
    samples = _samples(prompts, plan.rows, sampled, rewards, advantages, parts, settings, extras)
    return Generation(index, plan, rows, steps, metrics, samples, tokens=table.tokens())


def lay_out(plan: RowPlan, rows: Mapping[int, Row], advantages: torch.Tensor, loss_tokens: float,
            settings: RolloutSettings) -> tuple[tuple[dict[str, torch.Tensor], ...], ...]:  # fmt: skip
    """The micro-batches of `plan`: each its rows right-padded (`layout.micro_batch`), their
    "advantages" and the generation batch's "generation_tokens" (the dapo normaliser), on the device."""
    device = settings.device
    total = torch.tensor(float(loss_tokens), dtype=torch.float32, device=device)
    advantages = advantages.to(device=device, dtype=torch.float32)
    steps = []
    for step in plan.steps:
        micro_batches = []
        for micro in step:
            batch = micro_batch([rows[i] for i in micro], settings.pad_id, device)
            batch["advantages"] = advantages[torch.tensor(micro, device=device)]
            batch["generation_tokens"] = total
            micro_batches.append(batch)
        steps.append(tuple(micro_batches))
    return tuple(steps)


def completion_value(prompt: Any, text: str) -> Any:
    """A completion as reward functions get it (TRL): the text, or after a chat prompt (a list of
    messages) the assistant message [{"role": "assistant", "content": text}]."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


# ----------------------------------------------------------------------------- the phases


def _check_prompts(prompts: Sequence[Any], settings: RolloutSettings) -> None:
    if len(prompts) != settings.prompts:
        raise ValueError(f"a generation batch holds {settings.prompts} prompts (its rows over "
                         f"grpo.num_generations), got {len(prompts)}")  # fmt: skip


def _clock(device: torch.device) -> float:
    synchronize(device)  # the phase's work is done, not just queued
    return time.perf_counter()


def _autocast(settings: RolloutSettings) -> contextlib.AbstractContextManager:
    if settings.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(settings.device.type, dtype=settings.autocast_dtype)


def _sample(prompts: Sequence[Any], rows: Sequence[int], index: int, parts: RolloutParts,
            settings: RolloutSettings) -> dict[int, tuple[list[int], bool]]:  # fmt: skip
    """Row -> (completion ids, truncated) for this rank's rows, decoded `decode_batch_size` at a time,
    the policy in eval mode (restored after)."""
    grpo, group = settings.grpo, settings.grpo.num_generations
    sample = SampleSettings(max_new_tokens=grpo.max_completion_length, temperature=grpo.temperature,
                            top_k=grpo.top_k or None, top_p=grpo.top_p,
                            eos_id=settings.eos_ids or None)  # fmt: skip
    order = sorted(rows)
    chunk = grpo.decode_batch_size or len(order)
    policy, was_training = parts.policy, parts.policy.training
    out: dict[int, tuple[list[int], bool]] = {}
    policy.eval()
    try:
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            prompt_ids = [prompts[i // group].prompt_ids for i in part]
            generators = [row_generator(settings.seed, index, prompts[i // group].index, i % group) for i in part]
            with _autocast(settings):
                decoded = decode(policy, prompt_ids, sample, generators, device=settings.device,
                                 keep_going=parts.keep_going)  # fmt: skip
            for i, tokens, truncated in zip(part, decoded.tokens, decoded.truncated, strict=True):
                ends_with_pad = bool(tokens) and tokens[-1] == settings.pad_id
                out[i] = (list(tokens), truncated and not ends_with_pad)  # TRL: a last pad or EOS ends a row
    finally:
        policy.train(was_training)
    return out


@dataclass
class _Extras:
    """What reward functions logged through `log_metric(name, value)` and `log_extra(column, values)`."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)


def _score(prompts: Sequence[Any], sampled: Mapping[int, tuple[list[int], bool]], parts: RolloutParts,
           settings: RolloutSettings, trainer_state: Any) -> tuple[torch.Tensor, _Extras]:  # fmt: skip
    """[this rank's rows (sorted), functions] rewards, NaN where a function could not score a row."""
    group = settings.grpo.num_generations
    order = sorted(sampled)
    rows = [prompts[i // group] for i in order]
    completion_ids = [sampled[i][0] for i in order]
    completions = [completion_value(row.prompt, parts.decode_text(ids)) for row, ids in zip(rows, completion_ids, strict=True)]
    columns = {name: [row.columns[name] for row in rows] for name in (rows[0].columns if rows else {})}
    extras = _Extras()

    def where(position: int) -> str:
        i = order[position]
        return f"{rows[position].where}, completion {i % group + 1} of {group}"

    rewards = score_completions(
        parts.reward_functions, [row.prompt for row in rows], completions, completion_ids, columns, where=where,
        trainer_state=trainer_state, log_metric=lambda name, value: extras.metrics.setdefault(name, []).append(value),
        log_extra=lambda column, values: extras.columns.setdefault(column, []).extend(values),
    )  # fmt: skip
    return rewards, extras


def _extra_logps(steps: Sequence[Sequence[dict[str, torch.Tensor]]], parts: RolloutParts,
                 settings: RolloutSettings) -> None:  # fmt: skip
    """Each micro-batch's "old_logps" (only when the batch serves several optimizer steps: else the
    loss's ratio is exactly 1) and "ref_logps" (only when beta > 0), without gradient, 0 off the loss
    positions (what a checkpoint keeps of them is then all there is: a resume lays out the same tensors)."""
    keep_old = settings.steps > 1
    if not keep_old and parts.reference_logps is None:
        return
    with torch.no_grad(), _autocast(settings):
        for step in steps:
            for batch in step:
                off = batch["labels"][:, 1:] == IGNORE_INDEX
                if keep_old:
                    batch["old_logps"] = parts.policy_logps(parts.policy, batch).float().masked_fill(off, 0.0)
                if parts.reference_logps is not None:
                    batch["ref_logps"] = parts.reference_logps(parts.policy, batch).float().masked_fill(off, 0.0)


def _samples(prompts: Sequence[Any], rows: Sequence[int], sampled: Mapping[int, tuple[list[int], bool]],
             rewards: torch.Tensor, advantages: Any, parts: RolloutParts, settings: RolloutSettings,
             extras: _Extras) -> tuple[dict[str, Any], ...]:  # fmt: skip
    """The generation batch's first `completions_to_log` rows (by row index: the first prompts' groups),
    with their rewards (JSON data: NaN rewards as None), whichever ranks sampled them: the same records
    on every layout. Under several ranks each sends its share of them to all (one gather of a few small
    records per generation batch)."""
    group, count = settings.grpo.num_generations, settings.grpo.completions_to_log
    order = sorted(sampled)
    names = [function.name for function in parts.reward_functions]
    records = []
    for position, i in enumerate(order):
        if i >= count:
            break
        prompt = prompts[i // group]
        values = [None if value != value else value for value in rewards[position].tolist()]
        total = float(advantages.rewards[i])
        records.append((i, {
            "prompt": prompt.prompt, "completion": parts.decode_text(sampled[i][0]),
            "rewards": dict(zip(names, values, strict=True)), "reward": None if total != total else total,
            "advantage": float(advantages.advantages[i]), "prompt_index": prompt.index, "sample": i % group,
            "columns": dict(prompt.columns),
            **{column: logged[position] for column, logged in extras.columns.items() if position < len(logged)},
        }))  # fmt: skip
    if parts.gather_objects is not None and count:
        records = sorted(pair for share in parts.gather_objects(records) for pair in share)
    return tuple(record for _, record in records)
