"""`build_data` / `batches`: exact O(1) resume at any cursor, sharding, drop_last, workers, prefetch,
iterable datasets, and the iterator's lifetime inside `train` [S7] [S11] [S13] [S16]."""

from __future__ import annotations

import multiprocessing
import random
import threading
import warnings

import numpy as np
import pytest
import torch

from fntrain import RunPlan, TrainState, make_run_plan, train
from fntrain.data.pipeline import (
    batches,
    build_data,
    data_fn,
    dataset_length,
    micro_batch_sampler,
    position_hook,
    steps_per_epoch,
)
from fntrain.data.settings import Batching, LoaderConfig
from fntrain.data.stream import StreamPosition
from tests.data.datasets import Indexed, StatefulStream, Stream


def read_indices(iterator) -> list[list[list[int]]]:
    """Consume (and close) a `batches` iterator: each step as its micro-batches' sample indices."""
    try:
        return [[mb["index"].tolist() for mb in step] for step in iterator]
    finally:
        iterator.close()


def spec_of(dataset=None, *, mbs=2, n=2, dp_rank=0, dp_size=1, drop_last=True, shuffle=True, num_workers=0,
            prefetch=False, prefetch_depth=1, **options):  # fmt: skip
    dataset = Indexed(23) if dataset is None else dataset
    batching = Batching(mbs, n, seed=3, dp_rank=dp_rank, dp_size=dp_size, drop_last=drop_last)
    loader = LoaderConfig(shuffle, num_workers, prefetch, prefetch_depth, pin_memory=False)
    return build_data(dataset, batching, loader, **options)


def live_prefetch_threads() -> int:
    return sum(t.name.startswith("fntrain-prefetch") for t in threading.enumerate())


# ----------------------------------------------------------------------------- resume at any cursor


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("dp_rank", "dp_size"), [(0, 1), (1, 2), (2, 3)])
def test_every_cursor_gives_the_tail_of_the_epoch(prefetch, drop_last, dp_rank, dp_size):
    spec = spec_of(
        Indexed(29), mbs=2, n=2, drop_last=drop_last, dp_rank=dp_rank, dp_size=dp_size, prefetch=prefetch
    )
    full = read_indices(batches(spec, 1, 0))
    plan = make_run_plan(global_batch_size=4 * dp_size, micro_batch_size=2, dp_size=dp_size, train_iters=1,
                         dataset_len=29, drop_last=drop_last)  # fmt: skip
    assert len(full) == plan.steps_per_epoch == steps_per_epoch(spec)
    for cursor in range(len(full) + 2):
        assert read_indices(batches(spec, 1, cursor)) == full[cursor:]
    assert read_indices(batches(spec, 2, 0)) != full  # a new epoch, a new order
    assert live_prefetch_threads() == 0


@pytest.mark.parametrize("prefetch", [False, True])
def test_every_cursor_gives_the_tail_with_workers(prefetch):
    spec = spec_of(Indexed(29), drop_last=False, dp_rank=1, dp_size=2, num_workers=2, prefetch=prefetch)
    full = read_indices(batches(spec_of(Indexed(29), drop_last=False, dp_rank=1, dp_size=2), 1, 0))
    for cursor in range(len(full) + 1):
        assert read_indices(batches(spec, 1, cursor)) == full[cursor:]
    assert multiprocessing.active_children() == [] and live_prefetch_threads() == 0


def test_the_sampler_resumes_exactly_at_every_cursor_of_a_larger_epoch():
    spec = spec_of(Indexed(1000), mbs=3, n=4, dp_rank=1, dp_size=3, drop_last=False)
    full = list(micro_batch_sampler(spec, 5, 0))
    assert len(full) == steps_per_epoch(spec) * 4
    for cursor in range(steps_per_epoch(spec) + 1):
        assert list(micro_batch_sampler(spec, 5, cursor)) == full[cursor * 4 :]


def test_skipped_samples_are_never_read():
    dataset = Indexed(40)
    spec = spec_of(dataset, mbs=2, n=2)
    expected = read_indices(batches(spec, 0, 0))[7]
    dataset.reads.clear()
    iterator = batches(spec, 0, 7)
    assert dataset.reads == []  # lazy: nothing read before the first next()
    assert [mb["index"].tolist() for mb in next(iterator)] == expected
    assert sorted(dataset.reads) == sorted(i for mb in expected for i in mb)
    iterator.close()


def test_steps_per_epoch_matches_the_run_plan_on_every_rank():
    for length in (8, 9, 23, 24, 31):
        for dp_size in (1, 2, 3):
            for drop_last in (True, False):
                try:
                    plan = make_run_plan(global_batch_size=2 * 2 * dp_size, micro_batch_size=2, dp_size=dp_size,
                                         train_iters=1, dataset_len=length, drop_last=drop_last)  # fmt: skip
                except ValueError:
                    continue  # less than one step per epoch
                for rank in range(dp_size):
                    spec = spec_of(Indexed(length), drop_last=drop_last, dp_rank=rank, dp_size=dp_size)
                    assert len(read_indices(batches(spec, 0, 0))) == plan.steps_per_epoch


def test_drop_last_both_ways():
    # 23 samples over 2 ranks: drop_last drops the odd one (11 each: 5 micro-batches of 2 -> 2 steps of 2);
    # otherwise the order is padded with its head (12 each: 6 micro-batches -> 3 steps).
    dropped = [read_indices(batches(spec_of(drop_last=True, dp_rank=r, dp_size=2), 0, 0)) for r in range(2)]
    padded = [read_indices(batches(spec_of(drop_last=False, dp_rank=r, dp_size=2), 0, 0)) for r in range(2)]
    assert [len(steps) for steps in dropped] == [2, 2] and [len(steps) for steps in padded] == [3, 3]
    padded_samples = [i for steps in padded for step in steps for mb in step for i in mb]
    assert len(padded_samples) == 24 and set(padded_samples) == set(range(23))
    # A short last micro-batch: kept (in a whole step) without drop_last, dropped with it.
    keep = read_indices(batches(spec_of(Indexed(10), mbs=4, n=1, drop_last=False, shuffle=False), 0, 0))
    drop = read_indices(batches(spec_of(Indexed(10), mbs=4, n=1, drop_last=True, shuffle=False), 0, 0))
    assert keep == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    assert drop == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]


def test_getitems_is_used_like_a_dataloader_would():
    class Batched(Indexed):
        def __getitems__(self, indices):
            self.batched = getattr(self, "batched", 0) + 1
            return [self[i] for i in indices]

    dataset = Batched(8)
    assert len(read_indices(batches(spec_of(dataset), 0, 0))) == 2
    assert dataset.batched == 4


def test_collate_and_dataset_length():
    spec = spec_of(
        list(range(10)), collate_fn=lambda samples: {"index": torch.tensor(samples) * 10}, shuffle=False
    )
    assert read_indices(batches(spec, 0, 1)) == [[[40, 50], [60, 70]]]
    assert dataset_length(spec) == 10 and dataset_length(spec_of(Stream(5), shuffle=False)) is None


# ----------------------------------------------------------------------------- workers


def test_workers_give_identical_batches_and_leave_no_process_or_global_rng_draw():
    dataset = Indexed(30)
    in_process = spec_of(dataset, mbs=2, n=2)
    workers = spec_of(dataset, mbs=2, n=2, num_workers=2)
    workers_prefetch = spec_of(dataset, mbs=2, n=2, num_workers=2, prefetch=True)
    reference = [list(step) for step in batches(in_process, 4, 0)]
    rng_state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    got = [list(step) for step in batches(workers, 4, 0)]
    assert len(got) == len(reference) == 7
    for ours, theirs in zip(got, reference, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a["index"], b["index"]) and torch.equal(a["x"], b["x"])
    assert read_indices(batches(workers_prefetch, 4, 3)) == read_indices(batches(in_process, 4, 3))

    # Stop mid-epoch: the workers and the prefetch thread end with close().
    iterator = batches(workers_prefetch, 4, 1)
    next(iterator)
    assert multiprocessing.active_children()
    iterator.close()
    assert multiprocessing.active_children() == [] and live_prefetch_threads() == 0
    # The worker base seed came from the (seed, epoch) generator: no global draw anywhere.
    assert torch.equal(torch.get_rng_state(), rng_state[0]) and random.getstate() == rng_state[1]
    assert np.array_equal(np.random.get_state()[1], rng_state[2])


# ----------------------------------------------------------------------------- lifetime inside train


def run_pipeline(spec, *, fail_at: int | None = None, train_iters: int = 7):
    seen = []

    def step_fn(state, batch):
        if fail_at is not None and state.global_step + 1 == fail_at:
            raise RuntimeError(f"step {fail_at} failed")
        seen.append([mb["index"].tolist() for mb in batch])
        return {}

    per_epoch = steps_per_epoch(spec)
    plan = RunPlan(train_iters=train_iters, steps_per_epoch=per_epoch, epochs=-(-train_iters // per_epoch))
    train(TrainState(), step_fn, [], data=data_fn(spec), plan=plan)
    return seen


def test_train_sees_the_same_batches_with_prefetch_and_no_thread_outlives_it():
    baseline = threading.active_count()
    plain = run_pipeline(spec_of(Indexed(20)))
    prefetched = run_pipeline(spec_of(Indexed(20), prefetch=True, prefetch_depth=2))
    assert plain == prefetched and len(plain) == 7  # across two epochs and a mid-epoch end
    assert threading.active_count() == baseline


def test_stop_training_closes_the_prefetching_iterator():
    from fntrain import Event, StopTraining

    def stop_at_three(event, state, info):
        if event is Event.STEP_END and state.global_step == 3:
            raise StopTraining

    baseline = threading.active_count()
    spec = spec_of(Indexed(20), prefetch=True, num_workers=2)
    plan = RunPlan(train_iters=10, steps_per_epoch=5, epochs=2)
    final = train(TrainState(), lambda state, batch: {}, [stop_at_three], data=data_fn(spec), plan=plan).state
    assert final.global_step == 3
    assert threading.active_count() == baseline and multiprocessing.active_children() == []


def test_a_failing_step_stops_the_prefetch_thread_and_the_workers():
    baseline = threading.active_count()
    with pytest.raises(RuntimeError, match="step 3 failed"):
        run_pipeline(spec_of(Indexed(20), prefetch=True), fail_at=3)
    assert threading.active_count() == baseline
    with pytest.raises(RuntimeError, match="step 2 failed"):
        run_pipeline(spec_of(Indexed(20), prefetch=True, num_workers=2), fail_at=2)
    assert threading.active_count() == baseline
    assert multiprocessing.active_children() == []


def test_a_failing_dataset_reaches_train_through_the_prefetch_thread():
    class Broken(Indexed):
        def __getitem__(self, index):
            if len(self.reads) >= 6:
                raise IndexError(f"sample {index} is corrupt")
            return super().__getitem__(index)

    baseline = threading.active_count()
    with pytest.raises(IndexError, match="is corrupt"):
        run_pipeline(spec_of(Broken(20), prefetch=True))
    assert threading.active_count() == baseline
    # Raised in a DataLoader worker process, then on the prefetch thread, then in the trainer.
    with pytest.raises(IndexError, match="is corrupt"):
        run_pipeline(spec_of(Broken(20), prefetch=True, num_workers=2))
    assert threading.active_count() == baseline and multiprocessing.active_children() == []


def test_batches_starts_nothing_until_iterated():
    baseline = threading.active_count()
    iterator = batches(spec_of(prefetch=True, num_workers=2), 0, 0)
    assert threading.active_count() == baseline and multiprocessing.active_children() == []
    iterator.close()
    with pytest.raises(ValueError, match="cursor must be >= 0, got -1"):
        batches(spec_of(), 0, -1)


# ----------------------------------------------------------------------------- iterable datasets


def test_an_unsized_stream_ends_its_epoch_when_it_runs_out():
    spec = spec_of(Stream(11), shuffle=False)
    assert read_indices(batches(spec, 0, 0)) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # the partial step is dropped
    padded = spec_of(Stream(11), shuffle=False, drop_last=False)
    assert read_indices(batches(padded, 0, 0))[-1] == [[8, 9], [10]]
    assert read_indices(batches(spec, 2, 0))[0] == [[2000, 2001], [2002, 2003]]  # set_epoch(2) was called


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_stream_shards_are_disjoint_and_cover_it(world_size):
    for drop_last in (True, False):
        shards = [
            [i for step in read_indices(batches(spec_of(Stream(25), mbs=1, n=1, shuffle=False, drop_last=drop_last,
                                                dp_rank=r, dp_size=world_size), 0, 0))
             for mb in step for i in mb]
            for r in range(world_size)
        ]  # fmt: skip
        assert len({len(shard) for shard in shards}) == 1
        flat = [i for shard in shards for i in shard]
        if drop_last:
            assert sorted(flat) == list(range(25 - 25 % world_size))
        else:
            assert set(flat) == set(range(25)) and len(flat) == -(-25 // world_size) * world_size


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_stream_without_state_resumes_by_count_with_one_warning(prefetch):
    spec = spec_of(Stream(30), shuffle=False, prefetch=prefetch)
    full = read_indices(batches(spec, 1, 0))
    for cursor in range(1, len(full) + 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert read_indices(batches(spec, 1, cursor)) == full[cursor:]
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "has no state_dict/load_state_dict" in messages[0]
        assert f"discards its first {cursor * 4} samples" in messages[0]


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_stateful_stream_resumes_from_the_last_consumed_position(prefetch):
    dataset = StatefulStream(30)
    spec = spec_of(dataset, shuffle=False, prefetch=prefetch, prefetch_depth=2)
    full = read_indices(batches(spec, 1, 0))
    iterator = batches(spec, 1, 0)
    next(iterator), next(iterator)
    if prefetch:
        assert _eventually(lambda: dataset.read > 8)  # the thread read ahead ...
    saved = spec.position.state_dict()
    assert saved == {"epoch": 1, "cursor": 2, "dataset": {"position": 8}}  # ... the position did not move
    iterator.close()

    # A fresh process: new dataset object, position restored from the checkpoint, no samples re-read.
    resumed_dataset = StatefulStream(30)
    resumed = spec_of(resumed_dataset, shuffle=False, prefetch=prefetch)
    resumed.position.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_indices(batches(resumed, 1, 2)) == full[2:]
    assert resumed_dataset.loads == [{"position": 8}] and resumed_dataset.read == 30 - 8


def test_a_stateful_stream_without_a_saved_position_falls_back_to_count():
    spec = spec_of(StatefulStream(12), shuffle=False)
    full = read_indices(batches(spec, 0, 0))
    other = spec_of(StatefulStream(12), shuffle=False)
    with pytest.warns(RuntimeWarning, match="has no saved position for this"):
        assert read_indices(batches(other, 0, 1)) == full[1:]


def test_stream_position_round_trip_and_errors():
    position = StreamPosition()
    assert position.state_dict() == {}
    position.record(2, 5, {"offset": [1, 2]})
    state = position.state_dict()
    state["dataset"]["offset"].append(3)  # a copy: the saved position cannot be changed from outside
    assert position.resume_state(2, 5) == {"offset": [1, 2]} and position.resume_state(2, 4) is None
    other = StreamPosition()
    other.load_state_dict(position.state_dict())
    assert other.state_dict() == {"epoch": 2, "cursor": 5, "dataset": {"offset": [1, 2]}}
    other.load_state_dict({})
    assert other.state_dict() == {}
    with pytest.raises(ValueError, match=r"missing \['dataset'\]"):
        other.load_state_dict({"epoch": 0, "cursor": 1})


def test_the_position_hook_round_trips_through_the_hook_state_protocol():
    from fntrain.hooks.base import hook_states, load_hook_states

    spec = spec_of(StatefulStream(12), shuffle=False)
    iterator = batches(spec, 0, 0)
    next(iterator)
    iterator.close()
    saved = hook_states([position_hook(spec)])
    assert saved == {"data_position": {"epoch": 0, "cursor": 1, "dataset": {"position": 4}}}
    fresh = spec_of(StatefulStream(12), shuffle=False)
    assert load_hook_states([position_hook(fresh)], saved) == []
    assert fresh.position.resume_state(0, 1) == {"position": 4}


def _eventually(predicate, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# ----------------------------------------------------------------------------- validation


def test_build_data_validates_each_field_by_name():
    with pytest.raises(ValueError, match="loader.num_workers must be 0 for an iterable dataset"):
        spec_of(Stream(4), num_workers=2)
    with pytest.warns(UserWarning, match="loader.shuffle has no effect"):
        spec_of(Stream(4), shuffle=True)
    with pytest.raises(TypeError, match="data.dataset must be a map-style dataset"):
        spec_of(object())
    with pytest.raises(ValueError, match="data.dp_rank must be <= 1, got 2"):
        spec_of(dp_rank=2, dp_size=2)
    with pytest.raises(TypeError, match="loader.prefetch must be a bool, got 1"):
        spec_of(prefetch=1)
    with pytest.raises(ValueError, match="loader.prefetch_depth must be >= 1, got 0"):
        spec_of(prefetch_depth=0)
    with pytest.raises(ValueError, match="loader.num_workers must be >= 0, got -1"):
        spec_of(num_workers=-1)
    with pytest.raises(ValueError, match="data.multiprocessing_context must be one of"):
        spec_of(multiprocessing_context="threads")
    with pytest.raises(TypeError, match="data.collate_fn must be callable"):
        spec_of(collate_fn="stack")
