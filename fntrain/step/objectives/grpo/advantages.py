"""GRPO's advantages: each completion's reward against its group's, numbers as TRL 1.16's GRPOTrainer.

The generation batch's N = P·G rows are ordered prompt-major (row p·G + j is prompt p's j-th
completion). With the rewards R (N, F) of F functions (NaN where a function could not score a row),
weights w_f and nan-aware means and standard deviations (Bessel-corrected, NaN below two values):

    sum_then_normalize    r = Σ_f w_f R_f (NaN terms skipped)
                          A = (r − mean_group(r)) / (std + 1e-4),  std of the group ("group"), of the
                          whole batch ("batch"), or no division ("none": Dr. GRPO)
    normalize_then_sum    r = Σ_f w_f (R_f − mean_group(R_f)) / (std_group(R_f) + 1e-4)
                          A = (r − mean(r)) / (std(r) + 1e-4)      (batch statistics; scale_rewards unread)

A row no function could score has reward NaN (left out of every mean) and advantage 0, as has a row whose
group has too few scored rows for a standard deviation. The logged reward is Σ_f w_f R_f whatever the
aggregation; "frac_reward_zero_std" is the fraction of rows whose std above is 0 (isclose).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fntrain.config import require_choice, require_int

__all__ = ["Advantages", "group_advantages", "nanstd"]

_SCALE_REWARDS = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass(frozen=True)
class Advantages:
    """A generation batch's advantages (N,) float32 (0 for unscorable rows), its rewards (N,) (the
    weighted sum over functions, NaN where every function gave None) and TRL's reward metrics, 0-d
    tensors: "reward", "reward_std", "frac_reward_zero_std", "rewards/{name}/mean", "rewards/{name}/std"."""

    advantages: torch.Tensor
    rewards: torch.Tensor
    metrics: dict[str, torch.Tensor]


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation over `dim` (None: all) ignoring NaN, with Bessel's correction; NaN where fewer
    than two values are not NaN (TRL's `nanstd`)."""
    dims = dim if dim is not None else tuple(range(values.dim()))
    mean = torch.nanmean(values, dim=dims, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.nan)
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dims) if dim is not None else std.reshape(())


def group_advantages(
    rewards_per_func: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
    num_generations: int,
    scale_rewards: str,
    aggregation: str,
    names: Sequence[str],
) -> Advantages:
    """The advantages, rewards and reward metrics of a generation batch's `rewards_per_func` (N, F)
    float32 (NaN: the function could not score the row), rows prompt-major in groups of
    `num_generations`, functions weighted by `weights` (F,) and named by `names` (F) in the metrics.
    Formulas in the module docstring. Device ops only, no host sync."""
    rewards_per_func = _checked(rewards_per_func, weights, num_generations, names)
    require_choice("grpo.scale_rewards", scale_rewards, _SCALE_REWARDS)
    require_choice("grpo.multi_objective_aggregation", aggregation, _AGGREGATIONS)
    weight = torch.as_tensor(weights, dtype=torch.float32, device=rewards_per_func.device)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weight).nansum(dim=1).masked_fill(unscorable, torch.nan)
    if aggregation == "sum_then_normalize":
        advantages, std = _sum_then_normalize(rewards, num_generations, scale_rewards)
    else:
        advantages, std = _normalize_then_sum(rewards_per_func, weight, unscorable, num_generations)
    metrics = {"reward": torch.nanmean(rewards), "reward_std": nanstd(rewards)}
    metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    for index, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, index])
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, index])
    return Advantages(torch.nan_to_num(advantages, nan=0.0), rewards, metrics)


def _checked(
    rewards_per_func: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
    num_generations: int,
    names: Sequence[str],
) -> torch.Tensor:
    """`rewards_per_func` as float32 after the shape checks (ValueError naming what disagrees)."""
    require_int("grpo.num_generations", num_generations, min=1)
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be (rows, functions), got {tuple(rewards_per_func.shape)}")
    rows, functions = rewards_per_func.shape
    if rows % num_generations:
        raise ValueError(
            f"{rows} rewarded rows are not whole groups of grpo.num_generations {num_generations}"
        )
    if len(weights) != functions or len(names) != functions:
        raise ValueError(
            f"{functions} reward functions but {len(weights)} weights and {len(names)} names (one each)"
        )
    return rewards_per_func.float()


def _sum_then_normalize(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, the per-row std they are scaled by or checked against) of the weighted rewards."""
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # group, and none (where it only feeds frac_reward_zero_std)
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages, std


def _normalize_then_sum(
    rewards_per_func: torch.Tensor, weight: torch.Tensor, unscorable: torch.Tensor, num_generations: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, the batch std they are scaled by): each function scaled in its group, then weighted
    and summed, then scaled over the batch."""
    functions = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, functions)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean)
    scaled = ((grouped - mean) / (std + 1e-4)).view(-1, functions)
    rewards = (scaled * weight).nansum(dim=1).masked_fill(unscorable, torch.nan)
    batch_std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (batch_std + 1e-4), batch_std
