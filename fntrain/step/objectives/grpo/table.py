"""A generation batch's rows as every rank knows them after one all_reduce: their rewards, lengths and
truncation flags, and the metrics TRL logs of them; and the reward functions' own logged metrics.

Each rank scores only its rows; group advantages and TRL's completions/* metrics need every row, so the
rows are written into a table of zeros and summed over the data-parallel ranks (each row is one rank's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.loss import AllReduce

__all__ = ["RowTable", "gather_rows", "logged_means"]

@dataclass(frozen=True)
class RowTable:
    """Every row's rewards [C, F], completion and prompt lengths and truncation flags, on every rank."""

    rewards: torch.Tensor
    completion_lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    truncated: torch.Tensor

    def loss_tokens(self, grpo: GRPOConfig) -> float:
        """The generation batch's tokens carrying loss (TRL's num_items_in_batch)."""
        lengths = self.completion_lengths
        if grpo.mask_truncated_completions:
            lengths = lengths * (~self.truncated)
        return float(lengths.sum())

    def tokens(self) -> int:
        """Prompt and completion tokens of the whole batch (TRL's num_input_tokens_seen increment)."""
        return int(self.prompt_lengths.sum() + self.completion_lengths.sum())

    def metrics(self) -> dict[str, float]:
        """TRL's completions/* metrics over every row of the batch."""
        lengths = self.completion_lengths.float()
        terminated = lengths[~self.truncated]
        if terminated.numel() == 0:
            terminated = torch.zeros(1)
        return {
            "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(self.truncated.float().mean()),
            "completions/mean_terminated_length": float(terminated.mean()),
            "completions/min_terminated_length": float(terminated.min()),
            "completions/max_terminated_length": float(terminated.max()),
        }  # fmt: skip


def gather_rows(rewards: torch.Tensor, sampled: Mapping[int, tuple[list[int], bool]], prompts: Sequence[Any],
                settings: Any, all_reduce: AllReduce | None) -> RowTable:  # fmt: skip
    """Each rank's rows written into a [C, F + 3] table of zeros and summed over the ranks (every row is
    one rank's): rewards, completion length, prompt length, truncated. On the host: a few floats a row.
    `sampled`: this rank's row -> (completion ids, truncated); `rewards` their [rows, F] in row order."""
    group, functions = settings.grpo.num_generations, rewards.shape[1]
    table = torch.zeros(settings.rows, functions + 3, dtype=torch.float64)
    for position, i in enumerate(sorted(sampled)):
        tokens, truncated = sampled[i]
        table[i, :functions] = rewards[position].double()
        table[i, functions:] = torch.tensor([len(tokens), len(prompts[i // group].prompt_ids), float(truncated)])
    if all_reduce is not None and settings.dp_size > 1:
        table = all_reduce(table.to(settings.device), "sum").cpu()
    return RowTable(table[:, :functions].float(), table[:, functions].long(), table[:, functions + 1].long(),
                    table[:, functions + 2] > 0.5)  # fmt: skip


def logged_means(logged: Mapping[str, list[float]], all_reduce: AllReduce | None,
                 device: torch.device) -> dict[str, float]:  # fmt: skip
    """What reward functions logged through `log_metric(name, value)`: each name's mean over this batch,
    over every rank (the names every rank logged must agree: they are reduced in sorted order)."""
    if not logged:
        return {}
    names = sorted(logged)
    sums = torch.tensor([[sum(logged[name]), len(logged[name])] for name in names], dtype=torch.float64)
    if all_reduce is not None:
        sums = all_reduce(sums.to(device), "sum").cpu()
    return {name: float(total / max(count, 1.0)) for name, (total, count) in zip(names, sums.tolist(), strict=True)}
