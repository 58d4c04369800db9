"""The data order [S11]: a pure function of (seed, epoch, rank, world); sharding like DistributedSampler."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from fntrain.data.sampler import MicroBatchSampler, epoch_order, epoch_seed, rank_order, shard_order
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]

_ORDERS_SCRIPT = """
import json, random, sys
import numpy as np, torch
torch.manual_seed(int(sys.argv[1])); random.seed(int(sys.argv[1])); np.random.seed(int(sys.argv[1]))
from fntrain.data.pipeline import batches, build_data
from fntrain.data.settings import Batching
from fntrain.data.sampler import rank_order
out = {"orders": [rank_order(50, seed=7, epoch=e, shuffle=True, rank=r, world_size=3, drop_last=False).tolist()
                  for e in (0, 1) for r in range(3)]}
spec = build_data(list(range(23)), Batching(2, 2, seed=7, dp_rank=1, dp_size=2))
out["batches"] = [[mb.tolist() for mb in step] for step in batches(spec, 3, 1)]
print(json.dumps(out))
"""


def _orders_in_fresh_processes(*global_seeds: int) -> list[dict]:
    """Run the script in one fresh interpreter per global seed, concurrently."""

    def run(seed: int) -> subprocess.CompletedProcess:
        what = f"the order script with global seed {seed}"
        return run_to_end([sys.executable, "-c", _ORDERS_SCRIPT, str(seed)], what, 120, cwd=ROOT)

    with ThreadPoolExecutor(len(global_seeds)) as pool:
        done = list(pool.map(run, global_seeds))
    assert [proc.returncode for proc in done] == [0] * len(done), [proc.stderr[-2000:] for proc in done]
    return [json.loads(proc.stdout) for proc in done]


def test_order_is_identical_across_processes_and_ignores_the_global_rng():
    # Two interpreters with different global seeds (the trap: a draw from the global RNG shifts the order).
    first, second = _orders_in_fresh_processes(0, 12345)
    assert first == second
    from fntrain.data.pipeline import batches, build_data
    from fntrain.data.settings import Batching

    here = [rank_order(50, seed=7, epoch=e, shuffle=True, rank=r, world_size=3, drop_last=False).tolist()
            for e in (0, 1) for r in range(3)]  # fmt: skip
    spec = build_data(list(range(23)), Batching(2, 2, seed=7, dp_rank=1, dp_size=2))
    assert first["orders"] == here
    assert first["batches"] == [[mb.tolist() for mb in step] for step in batches(spec, 3, 1)]


def test_epoch_order_depends_on_seed_and_epoch_only():
    base = epoch_order(100, seed=1, epoch=0, shuffle=True)
    assert sorted(base.tolist()) == list(range(100))
    assert torch.equal(base, epoch_order(100, seed=1, epoch=0, shuffle=True))
    assert not torch.equal(base, epoch_order(100, seed=1, epoch=1, shuffle=True))
    assert not torch.equal(base, epoch_order(100, seed=2, epoch=0, shuffle=True))
    assert epoch_order(5, seed=1, epoch=3, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    assert epoch_seed(1, 0) != epoch_seed(1, 0, stream=1) != epoch_seed(0, 1)
    assert 0 <= epoch_seed(2**40, 2**20) < 2**63


def test_drawing_an_order_leaves_every_global_rng_untouched():
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    epoch_order(1000, seed=3, epoch=5, shuffle=True)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    np_after = np.random.get_state()
    assert np.array_equal(np_after[1], np_state[1]) and np_after[2:] == np_state[2:]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("length", [0, 1, 7, 12, 13])
def test_shards_are_disjoint_and_cover_the_order(world_size: int, length: int):
    order = epoch_order(length, seed=5, epoch=2, shuffle=True)
    for drop_last in (True, False):
        shards = [shard_order(order, rank=r, world_size=world_size, drop_last=drop_last).tolist()
                  for r in range(world_size)]  # fmt: skip
        sizes = {len(shard) for shard in shards}
        assert len(sizes) == 1  # every rank runs the same number of steps
        flat = [i for shard in shards for i in shard]
        if drop_last:
            # Disjoint, and together the whole order except a tail shorter than the world.
            assert len(set(flat)) == len(flat) == length - length % world_size
            assert set(flat) == set(order[: length - length % world_size].tolist())
        else:
            # Every sample seen; only the padding (< world samples, taken from the head) repeats.
            assert set(flat) == set(order.tolist())
            assert len(flat) - length == (-length % world_size if length else 0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_shards_match_torch_distributed_sampler(world_size: int, drop_last: bool):
    dataset = list(range(11))
    for rank in range(world_size):
        ours = rank_order(
            11, seed=0, epoch=0, shuffle=False, rank=rank, world_size=world_size, drop_last=drop_last
        )
        theirs = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=drop_last
        )
        assert ours.tolist() == list(theirs)


def test_shard_rank_is_validated():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_order(torch.arange(4), rank=2, world_size=2, drop_last=True)


def test_micro_batch_sampler_slices_without_touching_the_rest():
    indices = torch.arange(10) * 10
    sampler = MicroBatchSampler(indices, size=3, start=1, stop=4)
    assert len(sampler) == 3
    assert list(sampler) == [[30, 40, 50], [60, 70, 80], [90]]  # the last micro-batch may be short
    assert list(MicroBatchSampler(indices, 3, 4, 4)) == [] and len(MicroBatchSampler(indices, 3, 5, 4)) == 0
