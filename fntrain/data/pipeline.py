"""`build_data` and `batches`: the `data(epoch, cursor)` callable of the loop's contract [S11].

`batches(spec, epoch, cursor)` yields one global step's micro-batches at a time, starting at `cursor`
optimizer steps into `epoch`, by slicing the epoch's index order: skipped samples are never read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from fntrain.config import require_bool, require_int
from fntrain.data.sampler import epoch_order, shard_order

__all__ = ["DataSpec", "build_data", "batches", "data_fn"]


@dataclass(frozen=True)
class DataSpec:
    """Everything that decides what one rank reads in one epoch (frozen)."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    micro_batch_size: int
    micro_batches: int
    shuffle: bool = True
    seed: int = 42
    drop_last: bool = True
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def samples_per_step(self) -> int:
        """Samples this rank reads per optimizer step."""
        return self.micro_batch_size * self.micro_batches


def build_data(
    dataset: Any,
    *,
    micro_batch_size: int,
    micro_batches: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 42,
    drop_last: bool = True,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> DataSpec:
    """Validate the data settings and return the frozen spec `batches` reads."""
    require_int("data.micro_batch_size", micro_batch_size, min=1)
    require_int("data.micro_batches", micro_batches, min=1)
    require_bool("data.shuffle", shuffle)
    require_bool("data.drop_last", drop_last)
    require_int("data.seed", seed)
    require_int("data.dp_size", dp_size, min=1)
    require_int("data.dp_rank", dp_rank, min=0, max=dp_size - 1)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"data.dataset must be a map-style dataset (__getitem__ and __len__), got {type(dataset)!r}")
    return DataSpec(
        dataset=dataset,
        collate_fn=collate_fn or default_collate,
        micro_batch_size=micro_batch_size,
        micro_batches=micro_batches,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def rank_indices(spec: DataSpec, epoch: int) -> torch.Tensor:
    """This rank's sample indices for `epoch`, in order."""
    order = epoch_order(len(spec.dataset), seed=spec.seed, epoch=epoch, shuffle=spec.shuffle)
    return shard_order(order, rank=spec.dp_rank, world_size=spec.dp_size, drop_last=spec.drop_last)


def _step_index_groups(spec: DataSpec, epoch: int, cursor: int) -> Iterator[list[list[int]]]:
    indices = rank_indices(spec, epoch)[cursor * spec.samples_per_step :].tolist()
    mbs = spec.micro_batch_size
    micro = [indices[i : i + mbs] for i in range(0, len(indices), mbs)]
    if spec.drop_last and micro and len(micro[-1]) < mbs:
        micro.pop()
    for start in range(0, len(micro) - spec.micro_batches + 1, spec.micro_batches):
        yield micro[start : start + spec.micro_batches]


def batches(spec: DataSpec, epoch: int, cursor: int) -> Iterator[list[Any]]:
    """The remaining global batches of `epoch` from `cursor`: each a list of collated micro-batches."""
    require_int("cursor", cursor, min=0)
    dataset, collate = spec.dataset, spec.collate_fn
    for groups in _step_index_groups(spec, epoch, cursor):
        yield [collate([dataset[i] for i in group]) for group in groups]


def data_fn(spec: DataSpec) -> Callable[[int, int], Iterator[Sequence[Any]]]:
    """`batches` bound to `spec`: the `data` argument of `train`."""

    def data(epoch: int, cursor: int) -> Iterator[Sequence[Any]]:
        return batches(spec, epoch, cursor)

    return data
