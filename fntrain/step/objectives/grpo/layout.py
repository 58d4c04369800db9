"""Which completions of a generation batch each rank trains on, and how rows become micro-batches.

A generation batch has `rows` = P prompts x G completions, row i = p * G + j (prompt p's j-th completion).
Its rows are shuffled by a permutation seeded by (seed, generation index) (TRL shuffles each generation
batch too); the shuffled order is cut into optimizer steps of `global_batch` rows, each step's block
into one slice per data-parallel rank, each slice into micro-batches:

    order = shuffled_rows(rows, seed, generation)
    plan = plan_rows(order, steps=S // GA, micro_batches=GA, micro_batch_size=mb, dp_rank=r, dp_size=dp)
    plan.steps[k][m]      the row indices of rank r's micro-batch m in optimizer step k of a pass

The whole layout depends on the global batch only, never on the world size: the rows of optimizer step k
are the same on 1 process and on 8 ranks, so a step's gradient is too (each loss type's normaliser is
global). One process's micro-batch m is the m-th slice of the step's block, as TRL splits its shuffled
generation batch.

`micro_batch(rows, pad_id, device)` lays each row out right-padded as [prompt ids + completion ids], with
labels on the completion tokens it trains on (the schema `fntrain.step.objectives.grpo.loss` reads).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fntrain.data.tokens import IGNORE_INDEX

__all__ = ["shuffled_rows", "RowPlan", "plan_rows", "Row", "micro_batch"]


def shuffled_rows(rows: int, seed: int, generation: int) -> list[int]:
    """A permutation of range(rows), a pure function of (seed, generation)."""
    digest = hashlib.blake2b(f"grpo-order:{seed}:{generation}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randperm(rows, generator=generator).tolist()


@dataclass(frozen=True)
class RowPlan:
    """One rank's rows of a generation batch: `steps[k][m]` are the rows of micro-batch m of optimizer
    step k (within one pass over the batch)."""

    steps: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def rows(self) -> tuple[int, ...]:
        """Every row this rank trains on, in training order."""
        return tuple(row for step in self.steps for micro in step for row in micro)


def plan_rows(order: Sequence[int], *, steps: int, micro_batches: int, micro_batch_size: int, dp_rank: int,
              dp_size: int) -> RowPlan:  # fmt: skip
    """Rank `dp_rank`'s rows: `order` cut into `steps` blocks of micro_batches x micro_batch_size x
    dp_size rows, rank r's slice of each block the r-th, cut into `micro_batches` micro-batches."""
    per_rank = micro_batches * micro_batch_size
    per_step = per_rank * dp_size
    if len(order) != steps * per_step:
        raise ValueError(f"a generation batch of {len(order)} rows does not fill {steps} steps of {per_step}")
    plan = []
    for step in range(steps):
        start = step * per_step + dp_rank * per_rank
        mine = order[start : start + per_rank]
        plan.append(tuple(tuple(mine[m * micro_batch_size : (m + 1) * micro_batch_size]) for m in range(micro_batches)))
    return RowPlan(tuple(plan))


@dataclass(frozen=True)
class Row:
    """One completion as trained: its prompt's ids, its completion's ids (through the EOS when it has one)
    and whether its tokens carry loss (False: a truncated completion left out by mask_truncated_completions)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    trained: bool = True


def micro_batch(rows: Sequence[Row], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """`rows` right-padded to the longest as [prompt + completion]: "input_ids", "attention_mask" and the
    unshifted "labels" (completion ids where trained, IGNORE_INDEX elsewhere), on `device`."""
    width = max(len(row.prompt_ids) + len(row.completion_ids) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for index, row in enumerate(rows):
        prompt, completion = len(row.prompt_ids), len(row.completion_ids)
        ids[index, : prompt + completion] = torch.tensor(row.prompt_ids + row.completion_ids, dtype=torch.long)
        mask[index, : prompt + completion] = 1
        if row.trained:
            labels[index, prompt : prompt + completion] = ids[index, prompt : prompt + completion]
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
