"""`reduce_scalars` over a real 2-rank gloo group in one process: two threads, each holding its rank of
a `ProcessGroupGloo` on a shared in-memory store, stand in for two processes (gloo's collectives are
the same). One op is one all_reduce (mean divides by the world), mixed ops one all_gather reduced on the
host, tensors and host numbers together, in the caller's order; plus the one-rank and error paths."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from fntrain.runtime.collectives import exact_dtype, reduce_scalars


@pytest.fixture
def world_group(tmp_path):
    """An initialised 1-rank default group (reduce_scalars asks `dist.is_initialized()` first)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _on_two_ranks(fn):
    """[fn(group, rank) for rank 0, 1], each rank in its own thread with its own gloo group object."""
    store = dist.HashStore()
    results: list = [None, None]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
            results[rank] = fn(group, rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank hung in a collective"
    if errors:
        raise errors[0]
    return results


def test_one_op_is_one_all_reduce_over_both_ranks(world_group):
    def metrics(group, rank):
        values = {"loss": torch.tensor(1.0 + rank), "tokens": 10 * (rank + 1), "lr": torch.tensor([0.5])}
        return (
            reduce_scalars(values, group=group),
            reduce_scalars(values, "sum", group=group, dtype=exact_dtype(torch.device("cpu"))),
            reduce_scalars(values, "max", group=group),
        )

    for mean, total, largest in _on_two_ranks(metrics):
        assert list(mean) == ["loss", "tokens", "lr"]  # the caller's order, numbers and tensors mixed
        assert mean == {"loss": 1.5, "tokens": 15.0, "lr": 0.5}
        assert total == {"loss": 3.0, "tokens": 30.0, "lr": 1.0}
        assert largest == {"loss": 2.0, "tokens": 20.0, "lr": 0.5}


def test_mixed_ops_are_gathered_and_reduced_per_name(world_group):
    def metrics(group, rank):
        values = {
            "peak": 100.0 * (rank + 1),
            "step_time": torch.tensor(0.25 * (rank + 1)),
            "loss": 2.0 + rank,
        }
        return reduce_scalars(values, {"peak": "max", "step_time": "min"}, group=group)

    for result in _on_two_ranks(metrics):
        assert result == {"peak": 200.0, "step_time": 0.25, "loss": 2.5}  # loss: omitted, so a mean
        assert list(result) == ["peak", "step_time", "loss"]


def test_counts_stay_exact_in_float64_across_ranks(world_group):
    big = 2**40 + 1  # not representable in float32

    def metrics(group, rank):
        return reduce_scalars({"tokens": torch.tensor(big, dtype=torch.int64)}, "sum", group=group,
                              dtype=torch.float64)  # fmt: skip

    assert _on_two_ranks(metrics) == [{"tokens": float(2 * big)}] * 2


def test_one_rank_reads_values_back_unchanged(world_group):
    values = {"a": torch.tensor(3.0), "n": 4, "b": torch.tensor([[2.5]], dtype=torch.float64)}
    assert reduce_scalars(values, "sum") == {"a": 3.0, "n": 4.0, "b": 2.5}
    assert reduce_scalars({}) == {}


def test_bad_metrics_are_named():
    with pytest.raises(ValueError, match=r"metric 'x' must be a scalar, got a tensor of shape \(2,\)"):
        reduce_scalars({"x": torch.ones(2)})
    with pytest.raises(TypeError, match="metric 'y' must be a number or a scalar tensor, got str"):
        reduce_scalars({"y": "fast"})
    with pytest.raises(ValueError, match=r"reduce op for 'z' must be one of .*got 'median'"):
        reduce_scalars({"z": 1.0}, {"z": "median"})


def test_exact_dtype_is_float64_only_where_collectives_carry_it():
    assert exact_dtype(torch.device("cpu")) is torch.float64
    assert exact_dtype(torch.device("cuda", 0)) is torch.float64
    assert exact_dtype(torch.device("meta")) is torch.float32
