"""The data order: a pure function of (seed, epoch, rank, world size) [S11].

Every draw comes from a `torch.Generator` seeded from (seed, epoch), never from the global RNG, so a
resumed run sees the same order as an uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["epoch_seed", "epoch_generator", "epoch_order", "shard_order"]


def epoch_seed(seed: int, epoch: int, stream: int = 0) -> int:
    """A 63-bit seed derived from (seed, epoch, stream); distinct pairs give independent streams."""
    state = np.random.SeedSequence([seed, epoch, stream]).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(1))


def epoch_generator(seed: int, epoch: int, stream: int = 0) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(epoch_seed(seed, epoch, stream))
    return generator


def epoch_order(length: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global sample order of `epoch` (int64 indices), identical on every rank and every run."""
    if not shuffle:
        return torch.arange(length, dtype=torch.int64)
    return torch.randperm(length, generator=epoch_generator(seed, epoch))


def shard_order(order: torch.Tensor, *, rank: int, world_size: int, drop_last: bool) -> torch.Tensor:
    """This rank's disjoint slice of `order` (DistributedSampler semantics).

    drop_last=True drops the tail so every rank gets len // world samples; otherwise the order is padded
    by repeating its head so every rank gets ceil(len / world) samples.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    length = len(order)
    if drop_last:
        order = order[: length - length % world_size]
    elif length % world_size:
        pad = world_size - length % world_size
        repeats = -(-pad // length) if length else 0
        order = torch.cat([order, order.repeat(repeats)[:pad]]) if length else order
    return order[rank::world_size]
