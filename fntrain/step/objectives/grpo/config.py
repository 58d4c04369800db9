"""`GRPOConfig`: GRPO's settings under TRL 1.16's names and defaults (`trl.GRPOConfig`), one frozen record.

The batch settings are fntrain's own: `train.global_batch_size` counts completions per optimizer step (TRL's
per-device batch x processes x accumulation) and `train.micro_batch_size` completions per forward. A
generation batch holds `steps_per_generation` x micro-batch x data-parallel ranks completions (TRL's
`generation_batch_size`), `num_generations` per prompt; it is reused for `num_iterations` passes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from fntrain.config import (
    require_bool,
    require_choice,
    require_float,
    require_float_tuple,
    require_int,
    require_str,
)

__all__ = ["GRPOConfig", "LOSS_TYPES", "SCALE_REWARDS", "IMPORTANCE_SAMPLING_LEVELS", "AGGREGATIONS", "REFERENCES"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
REFERENCES = ("copy", "adapter-off")
_FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class GRPOConfig:
    """Online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO), numbers as TRL 1.16's GRPOTrainer."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("reference_path",)

    reward_funcs: tuple[str, ...] = ()
    """Reward functions as module:function (TRL's signature: fn(prompts, completions, completion_ids, **columns) -> list of float or None), e.g. fntrain.rewards:math_accuracy. Required."""
    reward_weights: tuple[float, ...] | None = None
    """One weight per reward function (None: 1.0 each)."""
    num_generations: int = 8
    """Completions sampled per prompt (the group whose rewards set each completion's advantage); >= 2."""
    max_completion_length: int = 512
    """Tokens per completion at most; a completion that reaches it without the EOS is truncated."""
    temperature: float = 1.0
    """Sampling temperature, > 0; the log-probabilities the loss uses are taken at it too, as TRL does."""
    top_p: float = 1.0
    """Nucleus sampling: draw among the most likely tokens holding this much probability, in (0, 1]."""
    top_k: int = 0
    """Draw only among the k most likely tokens (0: no cut)."""
    steps_per_generation: int | None = None
    """Micro-batch steps (per rank) one generation batch feeds, a multiple of the micro-batches per optimizer step (None: that number, so each optimizer step generates)."""
    num_iterations: int = 1
    """Passes over each generation batch (the paper's mu)."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference model (0: no reference is loaded or run)."""
    epsilon: float = 0.2
    """Clipping range of the importance ratio: [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher; None: epsilon)."""
    delta: float | None = None
    """Two-sided clipping: the unclipped ratio is also capped at delta (None: off); > 1."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: one importance ratio per token; sequence: one per completion (GSPO)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the std of the group's rewards, of the whole generation batch's, or not at all (Dr. GRPO)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """grpo: per-completion token mean; bnpo: token mean per micro-batch; dr_grpo: tokens over rows x max_completion_length; dapo: tokens over the generation batch's tokens (TRL's default)."""
    mask_truncated_completions: bool = False
    """Leave truncated completions (no EOS) out of the loss."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL by the importance ratio (TRL's default when beta > 0)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """How several reward functions combine: weighted sum then group scaling, or each scaled in its group first."""
    reference: Literal["copy", "adapter-off"] = "copy"
    """The KL's reference (beta > 0): copy, a frozen copy of the starting model; adapter-off, the policy with its LoRA adapter switched off (needs --lora.rank > 0)."""
    reference_path: str | None = None
    """The reference's local directory for reference copy (None: the policy's own --model.path)."""
    disable_dropout: bool = True
    """Switch dropout off in the policy (and reference), so on-policy importance ratios are exactly 1 (TRL's default: False)."""
    completions_to_log: int = 4
    """The generation batch's first completions (its first prompts' groups, whatever the ranks) written with their rewards to samples.jsonl and the trackers (0: none)."""
    decode_batch_size: int = 0
    """Rows each rank decodes together (0: all of its rows of a generation batch at once)."""

    def validate(self, prefix: str = "grpo") -> None:
        """Value rules naming `prefix.field` (the batch-shape rules need the run's batch: the objective's check)."""
        if not isinstance(self.reward_funcs, (tuple, list)) or not self.reward_funcs:
            raise ValueError(f"{prefix}.reward_funcs is required: one or more module:function names "
                             f"(e.g. fntrain.rewards:math_accuracy), got {self.reward_funcs!r}")  # fmt: skip
        for index, spec in enumerate(self.reward_funcs):
            require_str(f"{prefix}.reward_funcs[{index}]", spec, non_empty=True)
            if not _FUNCTION_SPEC.match(spec):
                raise ValueError(f"{prefix}.reward_funcs[{index}] must be module:function, got {spec!r}")
        if self.reward_weights is not None:
            require_float_tuple(f"{prefix}.reward_weights", self.reward_weights, length=len(self.reward_funcs))
        require_int(f"{prefix}.num_generations", self.num_generations, min=2)
        require_int(f"{prefix}.max_completion_length", self.max_completion_length, min=1)
        require_float(f"{prefix}.temperature", self.temperature, min=0.0, min_exclusive=True)
        require_float(f"{prefix}.top_p", self.top_p, min=0.0, max=1.0, min_exclusive=True)
        require_int(f"{prefix}.top_k", self.top_k, min=0)
        if self.steps_per_generation is not None:
            require_int(f"{prefix}.steps_per_generation", self.steps_per_generation, min=1)
        require_int(f"{prefix}.num_iterations", self.num_iterations, min=1)
        require_float(f"{prefix}.beta", self.beta, min=0.0)
        require_float(f"{prefix}.epsilon", self.epsilon, min=0.0, min_exclusive=True)
        if self.epsilon_high is not None:
            require_float(f"{prefix}.epsilon_high", self.epsilon_high, min=0.0, min_exclusive=True)
        if self.delta is not None:
            require_float(f"{prefix}.delta", self.delta, min=1.0, min_exclusive=True)
        require_choice(f"{prefix}.importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        require_choice(f"{prefix}.scale_rewards", self.scale_rewards, SCALE_REWARDS)
        require_choice(f"{prefix}.loss_type", self.loss_type, LOSS_TYPES)
        require_choice(f"{prefix}.multi_objective_aggregation", self.multi_objective_aggregation, AGGREGATIONS)
        for name in ("mask_truncated_completions", "use_bias_correction_kl", "disable_dropout"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_choice(f"{prefix}.reference", self.reference, REFERENCES)
        require_str(f"{prefix}.reference_path", self.reference_path, optional=True, non_empty=True)
        if self.reference_path is not None and self.reference == "adapter-off":
            raise ValueError(f"{prefix}.reference_path is not read with {prefix}.reference 'adapter-off' (the "
                             f"reference is the policy's own base model), got {self.reference_path!r}")  # fmt: skip
        require_int(f"{prefix}.completions_to_log", self.completions_to_log, min=0)
        require_int(f"{prefix}.decode_batch_size", self.decode_batch_size, min=0)

    @property
    def upper_epsilon(self) -> float:
        """The upper clipping range: epsilon_high, else epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per reward function."""
        return tuple(self.reward_weights) if self.reward_weights is not None else (1.0,) * len(self.reward_funcs)
