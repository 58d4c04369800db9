"""The data order: a pure function of (seed, epoch, rank, world size) [S11].

Every draw comes from a `torch.Generator` seeded from (seed, epoch), never from the global RNG, so a
resumed run sees the same order as an uninterrupted one. `MicroBatchSampler` cuts one rank's order into
micro-batches starting at a given micro-batch, so resuming at cursor k costs the same as starting at 0:
the skipped indices are never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "epoch_seed",
    "epoch_generator",
    "epoch_order",
    "shard_order",
    "rank_order",
    "MicroBatchSampler",
    "ORDER_STREAM",
    "WORKER_STREAM",
]

ORDER_STREAM = 0
"""Stream of `epoch_generator` that draws the epoch's sample order."""
WORKER_STREAM = 1
"""Stream of `epoch_generator` that draws the DataLoader's worker base seed."""


def epoch_seed(seed: int, epoch: int, stream: int = 0) -> int:
    """A 63-bit seed derived from (seed, epoch, stream); distinct triples give independent streams."""
    if seed < 0 or epoch < 0 or stream < 0:
        raise ValueError(
            f"seed, epoch and stream must be >= 0, got seed={seed}, epoch={epoch}, stream={stream}"
        )
    state = np.random.SeedSequence([seed, epoch, stream]).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(1))


def epoch_generator(seed: int, epoch: int, stream: int = 0) -> torch.Generator:
    """A fresh CPU `torch.Generator` seeded from (seed, epoch, stream)."""
    generator = torch.Generator()
    generator.manual_seed(epoch_seed(seed, epoch, stream))
    return generator


def epoch_order(length: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global sample order of `epoch` (int64 indices), identical on every rank and every run."""
    if not shuffle:
        return torch.arange(length, dtype=torch.int64)
    return torch.randperm(length, generator=epoch_generator(seed, epoch, ORDER_STREAM))


def shard_order(order: torch.Tensor, *, rank: int, world_size: int, drop_last: bool) -> torch.Tensor:
    """This rank's disjoint slice of `order` (`DistributedSampler` semantics).

    drop_last=True drops the tail so every rank gets len // world samples; otherwise the order is padded
    by repeating its head so every rank gets ceil(len / world) samples. Rank r takes positions r, r+world, ...
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    length = len(order)
    if drop_last:
        order = order[: length - length % world_size]
    elif length and length % world_size:
        pad = world_size - length % world_size
        repeats = -(-pad // length)
        order = torch.cat([order, order.repeat(repeats)[:pad]])
    return order[rank::world_size]


def rank_order(
    length: int, *, seed: int, epoch: int, shuffle: bool, rank: int, world_size: int, drop_last: bool
) -> torch.Tensor:
    """The sample indices one data-parallel rank reads in `epoch`, in order."""
    order = epoch_order(length, seed=seed, epoch=epoch, shuffle=shuffle)
    return shard_order(order, rank=rank, world_size=world_size, drop_last=drop_last)


@dataclass(frozen=True)
class MicroBatchSampler:
    """Micro-batches `start` .. `stop - 1` of one rank's order, as lists of indices (a DataLoader batch sampler).

    Micro-batch j holds `indices[j * size : (j + 1) * size]` (the last one may be short when the rank's
    order is not a multiple of `size`). Iterating touches only the micro-batches asked for, so a resumed
    epoch never reads the skipped part of the order.
    """

    indices: torch.Tensor
    size: int
    start: int
    stop: int

    def __iter__(self) -> Iterator[list[int]]:
        indices, size = self.indices, self.size
        for j in range(self.start, self.stop):
            yield indices[j * size : (j + 1) * size].tolist()

    def __len__(self) -> int:
        return max(0, self.stop - self.start)
