"""Behaviours of the streaming side of the data that mutation testing found unpinned (mutation/RESULTS.md):
which datasets are streams, which can save their position, what a resume of a stream does (put back, or
re-read and discard, with the warning that says which and why), that a rank's share closes the stream it
reads, and that a saved position is a copy nobody else can change."""

from __future__ import annotations

import warnings

import pytest
import torch

from fntrain.data.stream import StreamPosition, is_iterable_dataset, is_stateful, open_stream, rank_samples


class Only:
    """An object with exactly the named protocol methods (each a stand-in that is never called)."""

    def __init__(self, *names: str):
        self.names = names

    def __getattr__(self, name):
        if name in self.names:
            return lambda *a: None
        raise AttributeError(name)


def with_dunders(*names: str) -> object:
    """An instance of a class that defines exactly the dunder methods named (Python looks those up on the
    class)."""
    body = {
        "__getitem__": lambda self, i: i,
        "__len__": lambda self: 3,
        "__iter__": lambda self: iter(range(3)),
    }
    return type("Custom", (), {name: body[name] for name in names})()


class TenItems(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.parametrize(
    "dataset, stream",
    [
        (TenItems(), True),
        (with_dunders("__iter__"), True),  # iterable only
        (with_dunders("__getitem__", "__iter__"), True),  # indexable but no length: not map-style
        (with_dunders("__len__", "__iter__"), True),  # a length but no indexing: not map-style
        (with_dunders("__getitem__", "__len__"), False),
        (with_dunders("__getitem__", "__len__", "__iter__"), False),  # map-style wins
        ([1, 2, 3], False),
        (with_dunders(), False),
    ],
)
def test_a_stream_is_iterable_and_not_map_style(dataset, stream):
    assert is_iterable_dataset(dataset) is stream


@pytest.mark.parametrize(
    "names, stateful",
    [
        (("state_dict", "load_state_dict"), True),
        (("state_dict",), False),
        (("load_state_dict",), False),
        ((), False),
    ],
)
def test_a_stream_can_save_its_position_only_with_both_methods(names, stateful):
    assert is_stateful(Only(*names)) is stateful


class Counting:
    """A stateful stream without set_epoch: yields offset, offset+1, ... and keeps the state it was given
    (as some datasets do), advancing it as it yields."""

    def __init__(self):
        self.state = {"inner": {"offset": 0}}

    def __iter__(self):
        while True:
            value = self.state["inner"]["offset"]
            self.state["inner"]["offset"] += 1
            yield value

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def take(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_opening_twice_from_one_saved_position_gives_the_same_samples():
    position = StreamPosition()
    position.record(0, 2, {"inner": {"offset": 40}})
    dataset = Counting()
    for _ in range(2):  # a retried launch opens the same position again
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a put-back stream is not re-read: no warning
            opened = open_stream(dataset, epoch=0, cursor=2, samples_per_step=1, rank=0, world_size=1,
                                 drop_last=True, position=position)  # fmt: skip
        assert take(opened, 3) == [40, 41, 42]
        opened.close()


def test_a_stream_opened_at_cursor_zero_starts_at_its_start_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opened = open_stream(Counting(), epoch=0, cursor=0, samples_per_step=2, rank=0, world_size=1,
                             drop_last=True, position=None)  # fmt: skip
        assert take(opened, 2) == [0, 1]


@pytest.mark.parametrize(
    "dataset, position, reason",
    [
        (Counting(), None, "has no saved position for this (epoch, cursor)"),
        (Counting(), StreamPosition(), "has no saved position for this (epoch, cursor)"),
        (with_dunders("__iter__"), None, "has no state_dict/load_state_dict"),
    ],
)
def test_a_stream_without_its_position_is_re_read_and_the_warning_says_why(dataset, position, reason):
    with pytest.warns(RuntimeWarning) as caught:
        opened = open_stream(dataset, epoch=1, cursor=2, samples_per_step=1, rank=1, world_size=2,
                             drop_last=True, position=position)  # fmt: skip
    name = type(dataset).__name__
    assert [str(w.message) for w in caught] == [
        f"data: the iterable dataset {name} {reason}; resuming epoch 1 at cursor 2 re-reads and discards its "
        "first 4 samples"
    ]
    if isinstance(dataset, Counting):
        assert take(opened, 2) == [5, 7]  # samples 0-3 discarded; rank 1 of 2 keeps every second


def test_a_saved_position_is_a_copy_of_what_it_was_given():
    given = {"epoch": 1, "cursor": 3, "dataset": {"inner": {"offset": 7}}}
    position = StreamPosition()
    position.load_state_dict(given)
    given["dataset"]["inner"]["offset"] = 99  # the caller's dict changes later
    assert position.resume_state(1, 3) == {"inner": {"offset": 7}}
    assert position.state_dict() == {"epoch": 1, "cursor": 3, "dataset": {"inner": {"offset": 7}}}


def test_loading_an_empty_position_forgets_any_and_an_empty_one_stays_empty():
    fresh = StreamPosition()
    fresh.load_state_dict({})
    assert fresh.state_dict() == {}
    used = StreamPosition()
    used.record(0, 1, {"a": 1})
    used.load_state_dict({})
    assert used.state_dict() == {} and used.resume_state(0, 1) is None


def test_a_rank_share_without_skip_starts_at_the_first_sample():
    assert list(rank_samples(iter(range(5)), rank=0, world_size=1, drop_last=False)) == [0, 1, 2, 3, 4]


def test_closing_a_rank_share_closes_the_stream_it_reads():
    closed = []

    def stream():
        try:
            yield from range(100)
        finally:
            closed.append(True)  # a generator holding a file releases it here

    inner = stream()  # still referenced: only an explicit close() runs its clean-up now
    share = rank_samples(inner, rank=0, world_size=2, drop_last=True)
    assert take(share, 2) == [0, 2]
    share.close()
    assert closed == [True]
