"""fntrain.mesh_layout: the rank -> mesh coordinates arithmetic the plan and the profiler share agrees
with a row-major torch tensor of ranks shaped like the runtime's DeviceMesh (`build_mesh`)."""

from __future__ import annotations

import itertools

import pytest
import torch

from fntrain.hooks.profiler import ProfilerConfig, profiled_ranks
from fntrain.mesh_layout import group_ranks, mesh_dims, rank_coordinates, stage_leaders

LAYOUTS = [  # world, tp, pp, cp, replicate
    (1, 1, 1, 1, 1),
    (8, 2, 2, 1, 1),
    (8, 1, 1, 1, 1),
    (16, 2, 2, 2, 1),
    (32, 2, 2, 1, 2),
    (24, 4, 3, 1, 1),
    (16, 2, 1, 1, 4),
]


@pytest.mark.parametrize("world, tp, pp, cp, replicate", LAYOUTS)
def test_coordinates_and_groups_match_a_row_major_mesh(world, tp, pp, cp, replicate):
    dims = mesh_dims(world, tp_size=tp, pp_size=pp, cp_size=cp, replicate=replicate)
    names = [name for name, _ in dims]
    sizes = [size for _, size in dims]
    # What build_mesh hands init_device_mesh: pp, dp (or dp_replicate, dp_shard), cp, tp; 1s dropped.
    expected = [("pp", pp), ("dp_replicate", replicate), ("dp_shard", world // (tp * pp * cp) // replicate),
                ("cp", cp), ("tp", tp)] if replicate > 1 else [("pp", pp), ("dp", world // (tp * pp * cp)),
                                                               ("cp", cp), ("tp", tp)]  # fmt: skip
    assert list(dims) == [(n, s) for n, s in expected if n.startswith("dp") or s > 1]
    mesh = torch.arange(world).reshape(sizes)
    for index in itertools.product(*map(range, sizes)):
        rank = int(mesh[index])
        coords = rank_coordinates(rank, dims)
        assert [coords[name] for name in names] == list(index)
        for axis, name in enumerate(names):
            line = list(index)
            line[axis] = slice(None)
            assert group_ranks(rank, dims, name) == mesh[tuple(line)].tolist()
        if replicate > 1:  # "dp" is the flattened (dp_replicate, dp_shard) block
            axes = (names.index("dp_replicate"), names.index("dp_shard"))
            block = list(index)
            block[axes[0]] = block[axes[1]] = slice(None)
            flat = mesh[tuple(block)].flatten().tolist()
            assert group_ranks(rank, dims, "dp") == sorted(flat)
            assert flat.index(rank) == coords["dp"]


@pytest.mark.parametrize("world, pp", [(1, 1), (8, 2), (8, 4), (12, 3), (16, 16)])
def test_stage_leaders_are_each_stage_s_first_rank(world, pp):
    assert stage_leaders(world, pp) == [stage * world // pp for stage in range(pp)]
    config = ProfilerConfig(enabled=True, pipeline_stage_leaders=True)
    assert profiled_ranks(config, world, pp) == set(stage_leaders(world, pp))


def test_sizes_that_do_not_divide_the_world_name_the_field():
    with pytest.raises(ValueError, match="tp_size x pp_size x cp_size"):
        mesh_dims(6, tp_size=4)
    with pytest.raises(ValueError, match="replicate"):
        mesh_dims(8, replicate=3)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 8\)"):
        rank_coordinates(8, mesh_dims(8))
