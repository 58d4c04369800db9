"""Behaviours of the data pipeline that mutation testing found unpinned (mutation/RESULTS.md): every bad
setting is named as typed with its value, a spec holds exactly what it was built from, a stream's saved
position is a deep copy taken when the step is consumed, pinning happens on the prefetch thread and keeps
the stream position, and the position hook does nothing when the loop calls it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import default_collate

from fntrain.data import pipeline
from fntrain.data.pipeline import (
    DataSpec,
    batches,
    build_data,
    dataset_length,
    position_hook,
    steps_per_epoch,
)
from fntrain.data.settings import Batching, LoaderConfig
from tests.data.datasets import Indexed, StatefulStream, Stream
from tests.data.test_pipeline import read_indices
from tests.helpers.waiting import wait_until


def build_pipeline(dataset=None, batching: dict | None = None, loader: dict | None = None, **options):
    dataset = Indexed(12) if dataset is None else dataset
    shape = {
        "micro_batch_size": 2,
        "micro_batches": 1,
        "seed": 3,
        "dp_rank": 0,
        "dp_size": 1,
        "drop_last": True,
    }
    read_with = {
        "shuffle": False,
        "num_workers": 0,
        "prefetch": False,
        "prefetch_depth": 1,
        "pin_memory": False,
    }
    return build_data(dataset, Batching(**{**shape, **(batching or {})}), LoaderConfig(**{**read_with, **(loader or {})}),
                      **options)  # fmt: skip


BAD = [
    ({"micro_batch_size": 0}, {}, ValueError, "data.micro_batch_size must be >= 1, got 0"),
    ({"micro_batch_size": 2.0}, {}, TypeError, "data.micro_batch_size must be an int, got 2.0"),
    ({"micro_batches": 0}, {}, ValueError, "data.micro_batches must be >= 1, got 0"),
    ({"micro_batches": "2"}, {}, TypeError, "data.micro_batches must be an int, got '2'"),
    ({}, {"shuffle": 1}, TypeError, "loader.shuffle must be a bool, got 1"),
    ({"seed": -1}, {}, ValueError, "data.seed must be >= 0, got -1"),
    ({"seed": 1.5}, {}, TypeError, "data.seed must be an int, got 1.5"),
    ({"drop_last": 0}, {}, TypeError, "data.drop_last must be a bool, got 0"),
    ({"dp_size": 0}, {}, ValueError, "data.dp_size must be >= 1, got 0"),
    ({"dp_size": None}, {}, TypeError, "data.dp_size must be an int, got None"),
    ({"dp_rank": -1}, {}, ValueError, "data.dp_rank must be >= 0, got -1"),
    ({"dp_rank": 3, "dp_size": 3}, {}, ValueError, "data.dp_rank must be <= 2, got 3"),
    ({"dp_rank": "0"}, {}, TypeError, "data.dp_rank must be an int, got '0'"),
    ({}, {"num_workers": -1}, ValueError, "loader.num_workers must be >= 0, got -1"),
    ({}, {"num_workers": 1.0}, TypeError, "loader.num_workers must be an int, got 1.0"),
    ({}, {"pin_memory": "yes"}, TypeError, "loader.pin_memory must be a bool, got 'yes'"),
    ({}, {"prefetch": 1}, TypeError, "loader.prefetch must be a bool, got 1"),
    ({}, {"prefetch_depth": 0}, ValueError, "loader.prefetch_depth must be >= 1, got 0"),
    ({}, {"prefetch_depth": True}, TypeError, "loader.prefetch_depth must be an int, got True"),
]


@pytest.mark.parametrize(("batching", "loader", "kind", "message"), BAD)
def test_each_bad_setting_is_named_as_typed_with_its_value(batching, loader, kind, message):
    with pytest.raises(kind) as raised:
        build_pipeline(batching=batching, loader=loader)
    assert str(raised.value) == message


def test_bad_callables_contexts_and_datasets_are_named():
    cases = [
        ({"multiprocessing_context": "threads"}, ValueError,
         "data.multiprocessing_context must be one of ['fork', 'forkserver', 'spawn'], got 'threads'"),
        ({"collate_fn": "stack"}, TypeError, "data.collate_fn must be callable, got 'stack'"),
        ({"worker_init_fn": 3}, TypeError, "data.worker_init_fn must be callable, got 3"),
    ]  # fmt: skip
    for options, kind, message in cases:
        with pytest.raises(kind) as raised:
            build_pipeline(**options)
        assert str(raised.value) == message

    class OnlyGetitem:
        def __getitem__(self, index):
            return index

    class OnlyLen:
        def __len__(self):
            return 3

    for dataset in (object(), OnlyGetitem(), OnlyLen()):
        with pytest.raises(TypeError) as raised:
            build_pipeline(dataset)
        assert str(raised.value) == (
            "data.dataset must be a map-style dataset (__getitem__ and __len__) or an iterable one, "
            f"got {type(dataset).__name__}"
        )


def test_a_stream_read_by_workers_is_refused_and_shuffle_on_a_stream_warns():
    with pytest.raises(ValueError) as raised:
        build_pipeline(Stream(4), loader={"num_workers": 1})
    assert str(raised.value) == (
        "loader.num_workers must be 0 for an iterable dataset (Stream), got 1; use loader.prefetch to read "
        "the stream in the background"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_data(Stream(4), Batching(2, 1), LoaderConfig(shuffle=True, pin_memory=False))
        build_pipeline(Stream(4))  # shuffle=False: no warning
        build_pipeline(Indexed(4), loader={"shuffle": True})  # a map-style dataset shuffles: no warning
    assert [(w.category, str(w.message)) for w in caught] == [(
        UserWarning,
        "loader.shuffle has no effect on the iterable dataset Stream: a stream keeps its own order (its "
        "set_epoch(epoch) is called each epoch when it has one)",
    )]  # fmt: skip


def test_the_smallest_valid_settings_are_accepted_and_the_spec_holds_what_it_was_built_from():
    def collate(samples):
        return default_collate(samples)

    def init(worker_id):
        return None

    dataset = Indexed(9)
    spec = build_data(
        dataset, Batching(1, 1, seed=0, dp_rank=1, dp_size=2, drop_last=False),
        LoaderConfig(shuffle=False, num_workers=0, prefetch=True, prefetch_depth=1, pin_memory=True),
        collate_fn=collate, multiprocessing_context="spawn", worker_init_fn=init,
    )  # fmt: skip
    assert spec == DataSpec(
        dataset=dataset, collate_fn=collate, micro_batch_size=1, micro_batches=1, shuffle=False, seed=0,
        drop_last=False, dp_rank=1, dp_size=2, num_workers=0, pin_memory=True, prefetch=True, prefetch_depth=1,
        multiprocessing_context="spawn", worker_init_fn=init,
    )  # fmt: skip
    other = build_data(
        dataset,
        Batching(3, 4, seed=7, dp_rank=0, dp_size=1, drop_last=True),
        LoaderConfig(shuffle=True, num_workers=2, prefetch=False, prefetch_depth=5, pin_memory=False),
    )
    assert other == DataSpec(
        dataset=dataset, collate_fn=default_collate, micro_batch_size=3, micro_batches=4, shuffle=True, seed=7,
        drop_last=True, dp_rank=0, dp_size=1, num_workers=2, pin_memory=False, prefetch=False, prefetch_depth=5,
        multiprocessing_context=None, worker_init_fn=None,
    )  # fmt: skip
    assert other.samples_per_step == 12


def test_epoch_and_cursor_are_checked_and_zero_is_valid():
    spec = build_pipeline()
    with pytest.raises(ValueError) as raised:
        batches(spec, -1, 0)
    assert str(raised.value) == "epoch must be >= 0, got -1"
    with pytest.raises(TypeError) as raised:
        batches(spec, 0, 1.0)
    assert str(raised.value) == "cursor must be an int, got 1.0"
    assert read_indices(batches(spec, 0, 0))[0] == [[0, 1]]


def test_an_unsized_stream_has_no_length_and_no_steps_per_epoch():
    spec = build_pipeline(Stream(10))
    assert dataset_length(spec) is None and steps_per_epoch(spec) is None
    assert steps_per_epoch(build_pipeline(Indexed(10), batching={"micro_batch_size": 2, "micro_batches": 2})) == 2


class NestedLiveStream(StatefulStream):
    """A stateful stream whose `state_dict()` hands out one nested record it keeps updating as it reads
    (a shard cursor inside a dict): only a deep copy keeps the position of the step that was consumed."""

    def __init__(self, length: int):
        super().__init__(length)
        self.live = {"shard": {"offset": 0}}

    def __iter__(self):
        for sample in super().__iter__():
            self.live["shard"]["offset"] = self.position
            yield sample

    def state_dict(self) -> dict:
        return self.live


def test_the_saved_position_of_a_nested_live_stream_state_is_the_consumed_step():
    stream = NestedLiveStream(20)
    spec = build_pipeline(stream, loader={"prefetch": True, "prefetch_depth": 3})
    steps = batches(spec, 0, 0)
    try:
        assert next(steps)[0]["index"].tolist() == [0, 1]
        assert wait_until(lambda: stream.read >= 8)  # the prefetch thread has read three steps ahead
        assert spec.position.state_dict() == {"epoch": 0, "cursor": 1, "dataset": {"shard": {"offset": 2}}}
        next(steps)
        assert spec.position.resume_state(0, 2) == {"shard": {"offset": 4}}
    finally:
        steps.close()


def test_a_loader_that_cannot_start_raises_its_own_error(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("cannot start worker processes")

    monkeypatch.setattr(pipeline, "DataLoader", refuse)
    steps = batches(build_pipeline(Indexed(8), loader={"num_workers": 2}), 0, 0)
    with pytest.raises(OSError, match="^cannot start worker processes$"):
        next(steps)


def test_the_position_hook_does_nothing_when_the_loop_calls_it():
    spec = build_pipeline(StatefulStream(8))
    hook = position_hook(spec)
    assert hook.name == "data_position" and position_hook(spec, "stream").name == "stream"
    for event in ("start", "step_end", "end"):
        assert hook(event, None, None) is None
    assert spec.position.state_dict() == {}


@pytest.mark.parametrize("pin", [True, False])
def test_prefetched_steps_are_pinned_on_the_thread_when_an_accelerator_is_present(monkeypatch, pin):
    pinned: list[list[int]] = []

    def record(batch):
        pinned.append([mb["index"].tolist() for mb in batch])
        return [{**mb, "pinned": torch.tensor(1)} for mb in batch]

    monkeypatch.setattr(pipeline, "can_pin_memory", lambda: True)
    monkeypatch.setattr(pipeline, "pin_memory", record)
    spec = build_pipeline(StatefulStream(6), loader={"prefetch": True, "pin_memory": pin})
    steps = batches(spec, 0, 0)
    try:
        got = [step for step in steps]
    finally:
        steps.close()
    assert [[mb["index"].tolist() for mb in step] for step in got] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert all(("pinned" in step[0]) is pin for step in got)
    assert pinned == ([[[0, 1]], [[2, 3]], [[4, 5]]] if pin else [])
    assert spec.position.state_dict() == {"epoch": 0, "cursor": 3, "dataset": {"position": 6}}


# ----------------------------------------------------------------------------- worker processes, in one process
# The mutation run leaves out the tests that start real DataLoader workers for whole epochs (targets.py);
# these state the same contract with torch's DataLoader in one process: what it is given, that it reads
# the same steps from any cursor, and that close() ends its workers.


class Feeder:
    def __init__(self, joins: list):
        self.joins = joins

    def join(self, timeout=None):
        self.joins.append(timeout)


class Queue:
    def __init__(self, thread):
        self._thread = thread


class BareQueue:
    """An index queue with no feeder thread attribute at all."""


class FakeLoaderIter:
    """What iter(DataLoader(num_workers > 0)) is to `batches`: micro-batches, then `_shutdown_workers`
    and the index queues whose feeder threads must be joined."""

    def __init__(self, loader):
        self.loader, self.shutdowns, self.joins = loader, 0, []
        self._index_queues = [Queue(Feeder(self.joins)), Queue(None), BareQueue(), Queue(Feeder(self.joins))]
        self._micro = (
            loader.collate_fn([loader.dataset[i] for i in indices]) for indices in loader.batch_sampler
        )

    def __next__(self):
        return next(self._micro)

    def __iter__(self):
        return self

    def _shutdown_workers(self):
        self.shutdowns += 1


class FakeDataLoader:
    made: list[FakeDataLoader] = []

    def __init__(self, dataset, **kwargs):
        self.dataset, self.kwargs = dataset, kwargs
        self.batch_sampler, self.collate_fn = kwargs["batch_sampler"], kwargs["collate_fn"]
        self.iterators: list[FakeLoaderIter] = []
        FakeDataLoader.made.append(self)

    def __iter__(self):
        self.iterators.append(FakeLoaderIter(self))
        return self.iterators[-1]


@pytest.fixture
def fake_loader(monkeypatch):
    FakeDataLoader.made = []
    monkeypatch.setattr(pipeline, "DataLoader", FakeDataLoader)
    return FakeDataLoader


@pytest.mark.parametrize("prefetch", [False, True])
def test_with_workers_every_cursor_reads_the_tail_and_close_ends_the_workers(fake_loader, prefetch):
    shape = {"drop_last": False, "dp_rank": 1, "dp_size": 2}
    full = read_indices(batches(build_pipeline(Indexed(29), batching=shape, loader={"shuffle": True}), 1, 0))
    spec = build_pipeline(
        Indexed(29), batching=shape, loader={"shuffle": True, "num_workers": 2, "prefetch": prefetch}
    )
    assert fake_loader.made == []  # the in-process reference made none
    for cursor in range(len(full) + 1):
        assert read_indices(batches(spec, 1, cursor)) == full[cursor:]
    # One loader per resumed epoch that has steps left; none when the cursor is at the epoch's end.
    assert len(fake_loader.made) == len(full)
    for loader in fake_loader.made:
        (iterator,) = loader.iterators
        assert iterator.shutdowns == 1 and iterator.joins == [1.0, 1.0]


def test_with_workers_an_abandoned_epoch_ends_its_workers_too(fake_loader):
    spec = build_pipeline(Indexed(20), loader={"num_workers": 1})
    steps = batches(spec, 0, 0)
    next(steps)
    steps.close()
    (loader,) = fake_loader.made
    assert loader.iterators[0].shutdowns == 1


def test_workers_a_timed_out_prefetch_thread_still_reads_from_are_not_shut_down_under_it(
    fake_loader, monkeypatch
):
    class TimedOut(pipeline.Prefetcher):
        def stop(self, *args, **kwargs):
            super().stop(*args, **kwargs)
            return False  # as when the thread did not end within its timeout

    monkeypatch.setattr(pipeline, "Prefetcher", TimedOut)
    steps = batches(build_pipeline(Indexed(20), loader={"num_workers": 1, "prefetch": True}), 0, 0)
    next(steps)
    steps.close()
    (loader,) = fake_loader.made
    assert loader.iterators[0].shutdowns == 0  # left to the loader's own clean-up when it is released


class NoQueuesIter(FakeLoaderIter):
    """A loader iterator of a torch that keeps no index queues (or names them otherwise)."""

    def __init__(self, loader):
        super().__init__(loader)
        del self._index_queues


class NoShutdownIter:
    """A loader iterator of a torch without `_shutdown_workers`: nothing to end by hand."""

    def __init__(self, loader):
        self._micro = iter(FakeLoaderIter(loader)._micro)

    def __next__(self):
        return next(self._micro)

    def __iter__(self):
        return self


@pytest.mark.parametrize("kind", [NoQueuesIter, NoShutdownIter])
def test_closing_works_with_a_loader_iterator_without_torchs_private_shutdown_parts(
    fake_loader, monkeypatch, kind
):
    monkeypatch.setattr(FakeDataLoader, "__iter__", lambda self: kind(self))
    spec = build_pipeline(Indexed(8), loader={"num_workers": 2})
    assert read_indices(batches(spec, 0, 1)) == [[[2, 3]], [[4, 5]], [[6, 7]]]


def worker_generator_draws(generator) -> list[int]:
    return torch.randint(0, 2**30, (6,), generator=generator).tolist()


@pytest.mark.parametrize("accelerator", [False, True])
def test_the_dataloader_gets_the_spec_settings_and_an_epoch_seeded_worker_generator(
    fake_loader, monkeypatch, accelerator
):
    from fntrain.data.sampler import ORDER_STREAM, WORKER_STREAM, epoch_generator

    monkeypatch.setattr(pipeline, "can_pin_memory", lambda: accelerator)

    def collate(samples):
        return default_collate(samples)

    def init(worker_id):
        return None

    for pin in (False, True):
        spec = build_pipeline(Indexed(12), batching={"seed": 5}, loader={"num_workers": 3, "pin_memory": pin},
                     collate_fn=collate, multiprocessing_context="spawn", worker_init_fn=init)  # fmt: skip
        read_indices(batches(spec, 2, 0))
    first, second = fake_loader.made
    for loader, pin in ((first, False), (second, True)):
        kwargs = dict(loader.kwargs)
        generator = kwargs.pop("generator")
        assert worker_generator_draws(generator) == worker_generator_draws(epoch_generator(5, 2, WORKER_STREAM))
        assert worker_generator_draws(epoch_generator(5, 2, WORKER_STREAM)) != worker_generator_draws(epoch_generator(5, 2, ORDER_STREAM))
        assert list(kwargs.pop("batch_sampler")) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
        assert kwargs == {"num_workers": 3, "collate_fn": collate, "pin_memory": pin and accelerator,
                          "multiprocessing_context": "spawn", "worker_init_fn": init}  # fmt: skip
