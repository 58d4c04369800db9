"""Behaviours of the data order that mutation testing found unpinned (mutation/RESULTS.md): seeds use
all 63 bits and each stream is its own, bad input is named, and a rank's shuffled order is its slice of
the epoch's order for the seed and epoch it was asked for (the in-process half of the cross-process test,
which the mutation run leaves out for time)."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.sampler import (
    ORDER_STREAM,
    WORKER_STREAM,
    epoch_generator,
    epoch_order,
    epoch_seed,
    rank_order,
    shard_order,
)


def test_epoch_seeds_are_63_bit_and_use_all_of_them():
    seeds = [epoch_seed(seed, epoch, stream) for seed in range(8) for epoch in range(4) for stream in (0, 1)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) >= 2**62  # 64 draws: all below 2**62 would be a 1-in-2**64 accident
    assert any(s % 2 for s in seeds)  # not shifted left
    assert len(set(seeds)) == len(seeds)  # distinct triples, distinct seeds


def generator_draws(generator):
    return torch.randint(0, 2**30, (8,), generator=generator).tolist()


def test_each_stream_draws_its_own_numbers_and_the_default_is_the_order_stream():
    order, worker = epoch_generator(3, 1, ORDER_STREAM), epoch_generator(3, 1, WORKER_STREAM)
    assert generator_draws(order) != generator_draws(worker)
    assert generator_draws(epoch_generator(3, 1)) == generator_draws(epoch_generator(3, 1, ORDER_STREAM))
    assert generator_draws(epoch_generator(3, 1, WORKER_STREAM)) == generator_draws(epoch_generator(3, 1, WORKER_STREAM))


@pytest.mark.parametrize("seed,epoch,stream", [(-1, 0, 0), (0, -1, 0), (0, 0, -1)])
def test_a_negative_seed_epoch_or_stream_is_named(seed, epoch, stream):
    with pytest.raises(ValueError) as raised:
        epoch_seed(seed, epoch, stream)
    assert str(raised.value) == (
        f"seed, epoch and stream must be >= 0, got seed={seed}, epoch={epoch}, stream={stream}"
    )


def test_a_shuffled_rank_order_is_its_slice_of_the_epochs_order():
    for seed, epoch in ((5, 0), (5, 2), (11, 2)):
        expected = shard_order(epoch_order(30, seed=seed, epoch=epoch, shuffle=True), rank=1, world_size=3,
                               drop_last=True)
        got = rank_order(30, seed=seed, epoch=epoch, shuffle=True, rank=1, world_size=3, drop_last=True)
        assert got.tolist() == expected.tolist()
        assert got.tolist() != list(range(1, 30, 3))  # shuffled, not the identity's slice
    assert rank_order(30, seed=5, epoch=0, shuffle=True, rank=0, world_size=1, drop_last=True).tolist() != \
        rank_order(30, seed=5, epoch=1, shuffle=True, rank=0, world_size=1, drop_last=True).tolist()
    assert rank_order(30, seed=5, epoch=0, shuffle=True, rank=0, world_size=1, drop_last=True).tolist() != \
        rank_order(30, seed=6, epoch=0, shuffle=True, rank=0, world_size=1, drop_last=True).tolist()


def test_the_order_does_not_depend_on_the_global_rng():
    torch.manual_seed(0)
    first = epoch_order(50, seed=7, epoch=1, shuffle=True).tolist()
    torch.manual_seed(1)
    torch.rand(3)
    assert epoch_order(50, seed=7, epoch=1, shuffle=True).tolist() == first
    assert sorted(first) == list(range(50))


@pytest.mark.parametrize("epoch, order_seed, stream_1_seed, order", [
    (0, 5732826375231505755, 8008285204471158970, [7, 4, 2, 5, 1, 6, 0, 3]),
    (1, 7829184764001561178, 8144561418073184113, [4, 5, 3, 0, 1, 7, 2, 6]),
    (2, 5910823727984653262, 1650290129904687962, [2, 4, 6, 1, 5, 0, 7, 3]),
])  # fmt: skip
def test_each_epochs_seeds_and_order_stay_what_they_were(epoch, order_seed, stream_1_seed, order):
    """Recorded values (seed 42): a run resumed by a later fntrain draws the same order in every epoch,
    so a change to how (seed, epoch, stream) become a seed fails here, not silently on resume."""
    assert epoch_seed(42, epoch) == order_seed and epoch_seed(42, epoch, 1) == stream_1_seed
    assert epoch_order(8, seed=42, epoch=epoch, shuffle=True).tolist() == order
