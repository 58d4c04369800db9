"""HSDP (issue 12, item 3): `--parallel.replicate R` lays the data-parallel ranks out as a 2-D mesh
(R replicas x dp/R shards) that fully_shard shards over; R must divide the data-parallel size. Validation
here; 2 ranks (replicate 2, shard 1) matching DDP under torchrun in the slow tier."""

from __future__ import annotations

import pytest
import torch

from fntrain.runtime.parallel import ParallelConfig, hsdp_shape, parallelize
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from tests.runtime.scale_worker import launch


def test_replicate_must_be_a_positive_int():
    with pytest.raises(ValueError, match=r"parallel\.replicate.*0"):
        ParallelConfig(strategy="fsdp2", replicate=0).validate()
    with pytest.raises(TypeError, match=r"parallel\.replicate"):
        ParallelConfig(strategy="fsdp2", replicate=True).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_replicate_needs_fsdp2(strategy):
    with pytest.raises(
        ValueError, match=rf"parallel\.replicate=2 needs parallel\.strategy 'fsdp2'.*{strategy}"
    ):
        ParallelConfig(strategy=strategy, replicate=2).validate()  # type: ignore[arg-type]


def test_hsdp_shape_splits_data_parallel_ranks_into_replicas_of_shards():
    assert hsdp_shape(8, 2) == (2, 4)
    assert hsdp_shape(8, 8) == (8, 1)
    assert hsdp_shape(8, 1) == (1, 8)
    with pytest.raises(
        ValueError, match=r"parallel\.replicate \(3\) must divide the data-parallel size \(8\)"
    ):
        hsdp_shape(8, 3)


def test_setup_rejects_a_replicate_that_does_not_divide_the_world_before_any_group(one_rank_env):
    import torch.distributed as dist

    with pytest.raises(
        ValueError, match=r"parallel\.replicate \(2\) must divide the data-parallel size \(1\)"
    ):
        with setup_runtime(RuntimeConfig(), ParallelConfig(strategy="fsdp2", replicate=2)):
            pass
    assert not dist.is_initialized()


def test_parallelize_rejects_replicate_without_an_hsdp_runtime_mesh(one_rank_env):
    with setup_runtime(RuntimeConfig(), ParallelConfig(strategy="fsdp2")) as runtime:
        assert runtime.mesh.mesh_dim_names == ("dp",)
        with pytest.raises(ValueError, match=r"parallel\.replicate=2 .*setup_runtime"):
            parallelize(torch.nn.Linear(2, 2), runtime, ParallelConfig(strategy="fsdp2", replicate=2))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_rank_hsdp_replicate_2_shard_1_matches_ddp(tmp_path):
    out = tmp_path / "hsdp.pt"
    launch("hsdp", out)
    result = torch.load(out)
    ddp, hsdp = result["ddp"], result["hsdp"]
    assert result["world_size"] == 2
    assert hsdp["mesh"] == (("dp_replicate", "dp_shard"), (2, 1))
    assert hsdp["placements"] == ["(Replicate(), Shard(dim=0))"]  # a 2-D (HSDP) layout, not plain FSDP
    assert hsdp["dp"] == (0, 2)  # both ranks still read different data
    torch.testing.assert_close(
        torch.tensor(hsdp["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-6
    )
    assert ddp["weights"].keys() == hsdp["weights"].keys()
    for name, weight in ddp["weights"].items():
        torch.testing.assert_close(hsdp["weights"][name], weight, rtol=1e-5, atol=1e-6)
