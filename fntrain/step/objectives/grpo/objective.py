"""GRPO as one objective entry: its rules, data shape and plan lines from the config alone, and the
objective (forward, loss, rollout phase, checkpointed state) built over the run's parts.

    spec = ObjectiveSpec("grpo", build, check=check_grpo, generation=generation_shape, plan=plan_lines)
    objective, phase = grpo_objective(config.grpo, GRPOParts(...))     # in the recipe's `build`

The config is a recipe's job config with a `grpo` section (`GRPOConfig`), `train` and `seed`, and for an
adapter-off reference a `lora` section.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fntrain.state import TrainState
from fntrain.step.losses import default_forward
from fntrain.step.objective import GenerationShape, Objective
from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.loss import make_grpo_forward, make_grpo_loss
from fntrain.step.objectives.grpo.phase import RolloutPhase, rollout_phase
from fntrain.step.objectives.grpo.rollout import RolloutParts, RolloutSettings, rollout
from fntrain.step.objectives.logps import output_logits, token_logps
from fntrain.step.objectives.reference import adapter_off_reference, frozen_reference

__all__ = ["GRPOParts", "grpo_objective", "check_grpo", "generation_shape", "plan_lines", "group_all_reduce",
           "micro_batches_of", "steps_per_generation"]  # fmt: skip


def micro_batches_of(config: Any, dp_size: int) -> int:
    """Micro-batches per optimizer step on one rank (the run's first check made it whole)."""
    train = config.train
    return train.global_batch_size // (train.micro_batch_size * dp_size)


def steps_per_generation(config: Any, dp_size: int) -> int:
    """Micro-batch steps per rank one generation batch feeds: grpo.steps_per_generation, or one optimizer step."""
    return config.grpo.steps_per_generation or micro_batches_of(config, dp_size)


def check_grpo(config: Any, dp_size: int) -> None:
    """GRPO's rules across sections (the run's first phase): mean weighting, generation batches of whole
    optimizer steps and whole groups of completions, an adapter-off reference only with LoRA."""
    grpo, train = config.grpo, config.train
    if train.loss_weighting != "mean":
        raise ValueError("train.loss_weighting must be 'mean' for GRPO (its loss types normalise themselves), "
                         f"got {train.loss_weighting!r}")  # fmt: skip
    micro_batches = micro_batches_of(config, dp_size)
    steps = steps_per_generation(config, dp_size)
    if steps % micro_batches:
        raise ValueError(
            f"grpo.steps_per_generation ({steps}) must be a multiple of the micro-batches per optimizer step "
            f"({micro_batches}: train.global_batch_size / (train.micro_batch_size x {dp_size} data-parallel ranks))"
        )
    rows = steps * train.micro_batch_size * dp_size
    if rows % grpo.num_generations:
        where = ("train.global_batch_size" if steps == micro_batches else
                 f"the generation batch (grpo.steps_per_generation x train.micro_batch_size x {dp_size} ranks)")  # fmt: skip
        raise ValueError(f"{where} ({rows}) must be divisible by grpo.num_generations ({grpo.num_generations}): "
                         "a generation batch holds whole groups of completions")  # fmt: skip
    if grpo.beta > 0 and grpo.reference == "adapter-off" and not config.lora.enabled:
        raise ValueError("grpo.reference 'adapter-off' needs LoRA (lora.rank > 0): without an adapter the "
                         "policy is no reference")  # fmt: skip


def generation_shape(config: Any, dp_size: int) -> GenerationShape:
    """Prompts per generation batch and the optimizer steps it serves."""
    grpo, steps = config.grpo, steps_per_generation(config, dp_size)
    rows = steps * config.train.micro_batch_size * dp_size
    passes = steps // micro_batches_of(config, dp_size)
    return GenerationShape(prompts=rows // grpo.num_generations, steps=passes * grpo.num_iterations)


def plan_lines(config: Any, dp_size: int) -> dict[str, Any]:
    """The plan's rollout lines: the B x G rows of a generation batch, per rank, the steps it serves,
    the reference and the extra log-prob buffers per rank (float32 over the completion positions)."""
    grpo, shape = config.grpo, generation_shape(config, dp_size)
    rows = shape.prompts * grpo.num_generations
    buffers = (["old"] if shape.steps > 1 else []) + (["reference"] if grpo.beta > 0 else [])
    per_rank = rows // dp_size
    return {
        "objective": f"grpo ({grpo.loss_type}, beta {grpo.beta}, scale_rewards {grpo.scale_rewards})",
        "rollout": f"{shape.prompts} prompts x {grpo.num_generations} = {rows} completions per generation batch "
                   f"({per_rank} per rank), {shape.steps} optimizer step(s) each",  # fmt: skip
        "reference": ("none (beta 0)" if grpo.beta == 0 else grpo.reference),
        "logprob_buffers_per_rank": _buffers(buffers, per_rank, grpo.max_completion_length),
    }


def _buffers(names: list[str], rows: int, completion: int) -> str:
    """The extra log-prob buffers a rank keeps per generation batch, in words."""
    if not names:
        return "none (one optimizer step per batch and no KL: nothing but the policy's own forward)"
    completions = len(names) * rows * completion * 4 / 2**20
    return (f"{' and '.join(names)}: {rows} rows x (prompt + {completion}) float32 each "
            f"({completions:.2f} MiB for the completion positions)")


@dataclass(frozen=True)
class GRPOParts:
    """What the recipe built that GRPO runs over: the policy as trained (DDP-wrapped or sharded), the
    frozen reference (None: no KL, or an adapter-off reference), the tokenizer's decode, pad and EOS ids,
    the loaded reward functions, the run's seed and batch shape, device, autocast dtype and data-parallel
    rank, size and group, and whether the policy's weights are sharded (every rank then decodes in step)."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None
    decode_text: Callable[[Sequence[int]], str]
    pad_id: int
    eos_ids: tuple[int, ...]
    reward_functions: tuple[Any, ...]
    seed: int
    micro_batch_size: int
    micro_batches: int
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    sharded: bool = False


def group_all_reduce(group: Any) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """`all_reduce(tensor, op)` over `group` (op "sum", "min" or "max"), returning the reduced copy."""
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        reduced = tensor.clone()
        dist.all_reduce(reduced, op=ops[op], group=group)
        return reduced

    return all_reduce


def group_gather_objects(group: Any) -> Callable[[list[Any]], list[list[Any]]]:
    """`gather_objects(items)`: every rank of `group`'s items (picklable), in rank order, on every rank."""

    def gather_objects(items: list[Any]) -> list[list[Any]]:
        shares: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, items, group=group)
        return shares

    return gather_objects


def _keep_going(all_reduce: Callable[[torch.Tensor, str], torch.Tensor], device: torch.device) -> Callable[[bool], bool]:
    """Decode while any rank has an unfinished row: sharded weights are gathered by every rank's forward."""

    def keep_going(unfinished: bool) -> bool:
        return bool(all_reduce(torch.tensor([float(unfinished)], device=device), "max"))

    return keep_going


def grpo_objective(grpo: GRPOConfig, parts: GRPOParts) -> tuple[Objective, RolloutPhase]:
    """GRPO's objective over `parts`: the forward (per-token log-probs and entropy at the sampling
    temperature), the loss, the rollout phase before them and its checkpointed state; and the phase
    (its samples go to a hook the recipe adds)."""
    all_reduce = group_all_reduce(parts.dp_group) if parts.dp_size > 1 else None
    settings = RolloutSettings(grpo, parts.seed, parts.micro_batch_size, parts.micro_batches, parts.dp_rank,
                               parts.dp_size, parts.pad_id, parts.eos_ids, parts.device, parts.autocast_dtype)  # fmt: skip
    forward = make_grpo_forward(grpo.temperature)
    loss = make_grpo_loss(grpo, micro_batches=parts.micro_batches, steps_per_generation=settings.steps_per_generation,
                          dp_size=parts.dp_size, all_reduce=all_reduce)  # fmt: skip

    def score(output: Any, micro_batch: Any) -> torch.Tensor:
        return token_logps(output_logits(output), micro_batch["labels"], grpo.temperature)

    reference = None
    if grpo.beta > 0:
        reference = frozen_reference(parts.reference, score=score) if parts.reference is not None else \
            adapter_off_reference(score=score)  # fmt: skip
    policy = parts.policy.module if isinstance(parts.policy, torch.nn.parallel.DistributedDataParallel) else parts.policy
    rollout_parts = RolloutParts(
        policy, lambda model, micro_batch: score(default_forward(model, micro_batch), micro_batch), reference,
        parts.decode_text,
        tuple(parts.reward_functions), all_reduce,
        _keep_going(all_reduce, parts.device) if parts.sharded and all_reduce is not None else None,
        group_gather_objects(parts.dp_group) if parts.dp_size > 1 else None,
    )  # fmt: skip

    def generate(state: TrainState, prompts: Sequence[Any], index: int) -> Any:
        return rollout(prompts, index, rollout_parts, settings, trainer_state=state)

    phase = rollout_phase(generate, settings)
    objective = Objective(forward, loss, rollout=phase.step, hooks=(phase.state_hook,), count_batch=phase.count_batch)
    return objective, phase
