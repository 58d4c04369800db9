"""GRPO's forward and loss as a step's `forward` and `loss_fn`, numbers as TRL 1.16's GRPOTrainer.

    forward = make_grpo_forward(config.temperature)       # -> GRPOOutput(logps, entropy)
    loss_fn = make_grpo_loss(config, micro_batches=GA, steps_per_generation=S, dp_size=dp, all_reduce=reduce)

Per token t of a row with advantage A, the policy's log-prob π_t (at the sampling temperature), the
sampling policy's π_old,t (the micro-batch's "old_logps"; π_t itself, detached, when it has none: the
on-policy ratio is exactly 1) and the reference's ρ_t ("ref_logps", read when β > 0), over the loss
mask m_t (labels[:, 1:] != IGNORE_INDEX):

    w_t     = π_t − π_old,t                      token importance sampling
    w       = Σ_t m_t w_t / max(1, Σ_t m_t)      sequence importance sampling (GSPO): one per row
    r       = exp(w),  r̄ = clamp(r, 1 − ε, 1 + ε_high),  r ← min(r, δ) when δ is set (two-sided clipping)
    KL_t    = exp(ρ_t − π_t) − (ρ_t − π_t) − 1  (k3),  times exp(w) when use_bias_correction_kl
    ℓ_t     = −min(r A, r̄ A) + β KL_t

and the micro-batch's loss is TRL's `_compute_loss` value times the micro-batches per optimizer step
(GA): fntrain's step divides each by GA ("mean" weighting) where TRL divides itself. Over B rows:

    grpo      mean over rows of Σ_t m_t ℓ_t / max(1, Σ_t m_t)
    bnpo      Σ m ℓ / max(1, Σ m)
    dr_grpo   Σ m ℓ / (B · max_completion_length)
    dapo      Σ m ℓ / (max(1, N) / (dp · S))     N: the generation batch's loss tokens over all ranks,
                                                 S: steps_per_generation (micro-steps per generation per rank)

Data-parallel ranks average gradients (DDP/FSDP), as accelerate does under TRL, so dapo's per-rank
normaliser N / dp matches TRL's N / num_processes. Metrics are TRL's, global over the ranks' rows of
this micro-step (`_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.config import require_int
from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.losses import default_forward
from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.logps import full_logits, output_logits, token_entropy, token_logps

__all__ = [
    "GRPOOutput",
    "TokenObjective",
    "AllReduce",
    "make_grpo_forward",
    "grpo_token_loss",
    "make_grpo_loss",
]

AllReduce = Callable[[torch.Tensor, str], torch.Tensor]
"""`all_reduce(tensor, op) -> reduced tensor` over the data-parallel ranks, op "sum" | "min" | "max"."""


@dataclass(frozen=True)
class GRPOOutput:
    """What the GRPO forward returns, both (B, T-1) float32 aligned with labels[:, 1:] and 0 where the
    label is ignored: the policy's per-token log-probs at the sampling temperature (with gradient) and
    the entropy of its next-token distribution there (detached)."""

    logps: torch.Tensor
    entropy: torch.Tensor


@dataclass(frozen=True)
class TokenObjective:
    """`grpo_token_loss`'s result: the per-token loss ℓ (B, T-1); the importance ratio r after δ's cap,
    (B, T-1) at token level or (B, 1) at sequence level, detached; the per-token KL (B, T-1),
    detached, or None when β = 0."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


def make_grpo_forward(
    temperature: float,
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] = default_forward,
    ignore_index: int = IGNORE_INDEX,
) -> Callable[[torch.nn.Module, Mapping[str, Any]], GRPOOutput]:
    """`forward(model, micro_batch) -> GRPOOutput`: the policy's logits through `forward`, then their
    per-token log-probs and entropy at `temperature` against micro_batch["labels"] (vocabulary-parallel
    logits gathered whole; the logits are dropped here: only the log-probs' backward keeps them)."""

    def grpo_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> GRPOOutput:
        labels = micro_batch["labels"]
        logits = full_logits(output_logits(forward(model, micro_batch)))  # gathered once for both
        logps = token_logps(logits, labels, temperature, ignore_index)
        entropy = token_entropy(logits, temperature).masked_fill(labels[:, 1:] == ignore_index, 0.0)
        return GRPOOutput(logps, entropy)

    return grpo_forward


def grpo_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig,
) -> TokenObjective:
    """ℓ per token (formulas in the module docstring), as TRL 1.16's `_compute_loss` builds it.

    `logps`, `old_logps` (None: on-policy, logps detached), `ref_logps` (read when config.beta > 0)
    and the bool `mask` are (B, T-1); `advantages` (B,). Masked positions may hold anything finite."""
    advantages = advantages.unsqueeze(1)
    old_logps = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old_logps
    if config.importance_sampling_level == "sequence":
        tokens = mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.masked_fill(~mask, 0.0).sum(-1, keepdim=True) / tokens
    ratio = torch.exp(log_ratio)
    kl = None
    if config.beta > 0:
        if ref_logps is None:
            raise ValueError(f"grpo.beta {config.beta} > 0 needs the micro-batch's 'ref_logps', got none")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if config.use_bias_correction_kl:
            kl = kl * ratio
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.upper_epsilon)
    if config.delta is not None:
        ratio = torch.clamp(ratio, max=config.delta)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if kl is not None:
        loss = loss + config.beta * kl
    return TokenObjective(loss, ratio.detach(), None if kl is None else kl.detach())


def _normalised_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    micro_batch: Mapping[str, Any],
    config: GRPOConfig,
    scale: float,
) -> torch.Tensor:
    """The micro-batch's loss for config.loss_type: TRL's value times GA (module docstring). `scale`
    is dp · S (dapo's share of the generation batch one rank's micro-step stands for)."""
    masked = token_loss.masked_fill(~mask, 0.0)
    if config.loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if config.loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if config.loss_type == "dr_grpo":
        return masked.sum() / (masked.shape[0] * config.max_completion_length)
    generation_tokens = micro_batch.get("generation_tokens")
    if generation_tokens is None:
        raise ValueError("grpo.loss_type 'dapo' needs the micro-batch's 'generation_tokens', got none")
    return masked.sum() * scale / torch.as_tensor(generation_tokens, dtype=torch.float32).clamp(min=1)


def make_grpo_loss(
    config: GRPOConfig,
    *,
    micro_batches: int,
    steps_per_generation: int,
    dp_size: int = 1,
    all_reduce: AllReduce | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Callable[[GRPOOutput, Mapping[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """`loss_fn(output, micro_batch) -> (loss, metrics)` for the step's "mean" weighting over
    `micro_batches` (GA) micro-batches per optimizer step: TRL's per-micro-step loss times GA (module
    docstring), and TRL's metrics ("kl" when beta > 0, "entropy", "clip_ratio/low_mean", "/high_mean",
    "/region_mean", "/low_min", "/high_max"), detached 0-d tensors global over the `dp_size` ranks'
    rows of this micro-step through `all_reduce` (None: one process). Two collectives a micro-batch,
    no host sync. A micro-batch without loss tokens has loss 0 (its token means read 0, its
    low_min/high_max NaN as TRL's nanmin/nanmax of no rows)."""
    config.validate()
    require_int("micro_batches", micro_batches, min=1)
    require_int("steps_per_generation", steps_per_generation, min=1)
    require_int("dp_size", dp_size, min=1)
    if steps_per_generation % micro_batches:
        raise ValueError(
            f"grpo.steps_per_generation must be a multiple of the micro-batches per optimizer step "
            f"({micro_batches}), got {steps_per_generation}"
        )
    reduce = all_reduce if all_reduce is not None else (lambda tensor, op: tensor)
    scale = float(dp_size * steps_per_generation)

    def grpo_loss_fn(
        output: GRPOOutput, micro_batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = micro_batch["labels"][:, 1:] != ignore_index
        if output.logps.shape != mask.shape:
            raise ValueError(
                f"the GRPO log-probs {tuple(output.logps.shape)} do not match labels[:, 1:] {tuple(mask.shape)}"
            )
        advantages = micro_batch["advantages"]
        objective = grpo_token_loss(
            output.logps, micro_batch.get("old_logps"), micro_batch.get("ref_logps"), advantages, mask, config
        )
        loss = _normalised_loss(objective.loss, mask, micro_batch, config, scale)
        return loss, _metrics(objective, output.entropy, advantages, mask, config, reduce)

    return grpo_loss_fn


def _metrics(
    objective: TokenObjective,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig,
    reduce: AllReduce,
) -> dict[str, torch.Tensor]:
    """TRL's logged values for one micro-step, over every rank's rows (its `global_masked_mean`,
    `masked_seq_mean`, `nanmin`, `nanmax`): token-masked means of the KL, the entropy and the clipped
    fractions (one value per row at sequence level, every row counted), from one `reduce(.., "sum")`
    of sums and counts; the least low-clipped and the most high-clipped row (rows without tokens left
    out; NaN when no rank has one) from one `reduce(.., "max")`, the minimum taken as −max(−x)."""
    with torch.no_grad():
        weights = mask.float()
        tokens = weights.sum()
        low, high, region, clip_weights = _clipped(objective.ratio, advantages, weights, config)
        clip_count = clip_weights.sum()
        kl_sums = [(objective.kl * weights).sum()] if objective.kl is not None else []
        clip_sums = [(flags * clip_weights).sum() for flags in (low, high, region)]
        sums = reduce(
            torch.stack([*kl_sums, (entropy * weights).sum(), *clip_sums, tokens, clip_count]), "sum"
        )
        token_count, clip_total = sums[-2].clamp(min=1), sums[-1].clamp(min=1)
        means = sums[:-2] / torch.stack([token_count] * (len(kl_sums) + 1) + [clip_total] * 3)
        names = (
            ["kl"] * len(kl_sums) + ["entropy"] + [f"clip_ratio/{n}_mean" for n in ("low", "high", "region")]
        )
        metrics = dict(zip(names, means.unbind(), strict=True))
        row_counts = clip_weights.sum(-1)  # 0/0 = NaN for a row without tokens: left out below
        low_rows, high_rows = (
            (low * clip_weights).sum(-1) / row_counts,
            (high * clip_weights).sum(-1) / row_counts,
        )
        extremes = reduce(torch.stack([_nan_max(-low_rows), _nan_max(high_rows)]), "max")
        extremes = extremes.masked_fill(torch.isinf(extremes), torch.nan)  # no row on any rank
        metrics["clip_ratio/low_min"], metrics["clip_ratio/high_max"] = -extremes[0], extremes[1]
        return metrics


def _clipped(
    ratio: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, config: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(low, high, region, weights) as floats of ratio's shape: the ratio clipped below 1 − ε with a
    negative advantage, above 1 + ε_high with a positive one, either; and what each value counts for
    (the token mask at token level, 1 per row at sequence level)."""
    advantages = advantages.unsqueeze(1)
    low = (ratio < 1 - config.epsilon) & (advantages < 0)
    high = (ratio > 1 + config.upper_epsilon) & (advantages > 0)
    clip_weights = weights if ratio.shape[1] != 1 else torch.ones_like(ratio, dtype=weights.dtype)
    return low.to(weights.dtype), high.to(weights.dtype), (low | high).to(weights.dtype), clip_weights


def _nan_max(values: torch.Tensor) -> torch.Tensor:
    """The largest non-NaN value, −inf when there is none (TRL's nanmax before its NaN)."""
    return (
        torch.where(torch.isnan(values), -torch.inf, values).amax()
        if values.numel()
        else values.new_tensor(-torch.inf)
    )
