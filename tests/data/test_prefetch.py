"""The prefetch thread [S16]: bounded queue, errors in the trainer thread, exhaustion, stop(timeout)."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import pytest

from fntrain.data.prefetch import Prefetcher
from tests.helpers.waiting import wait_until


class GatedSource:
    """An iterator that records what it produced and whether it was closed; `gate` blocks each next()."""

    def __init__(self, items, *, gate: threading.Event | None = None, fail_at: int | None = None):
        self.items = list(items)
        self.produced = 0
        self.closed = False
        self.gate = gate
        self.fail_at = fail_at
        self.entered = threading.Event()
        self.thread_names: set[str] = set()

    def __iter__(self):
        return self

    def __next__(self):
        self.thread_names.add(threading.current_thread().name)
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if self.fail_at is not None and self.produced == self.fail_at:
            raise KeyError("bad sample")
        if self.produced >= len(self.items):
            raise StopIteration
        self.produced += 1
        return self.items[self.produced - 1]

    def close(self):
        self.closed = True


def stack_of(thread: threading.Thread | None) -> list[str]:
    """The names of the functions `thread` is inside now, innermost first ([] once it ended)."""
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def waiting_in(thread: threading.Thread | None, queue_method: str) -> bool:
    """True while `thread` waits inside the queue's `put` or `get` (the queue's own frames, so the check
    holds however the prefetch functions are wrapped: mutmut's trampoline renames their frames)."""
    return stack_of(thread)[:2] == ["wait", queue_method]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fntrain-prefetch")]


def test_yields_items_in_order_then_ends_and_stops_its_thread():
    baseline = threading.active_count()
    source = GatedSource(range(10))
    prefetcher = Prefetcher(source)
    assert list(prefetcher) == list(range(10))
    assert next(prefetcher, "end") == "end"  # exhausted stays exhausted
    assert not prefetcher.alive
    assert source.closed
    assert source.thread_names == {"fntrain-prefetch"}  # read on the worker, not the consumer
    assert threading.active_count() == baseline


def test_queue_is_bounded_by_depth():
    for depth in (1, 3):
        source = GatedSource(range(100))
        prefetcher = Prefetcher(source, depth=depth)

        # The worker fills the queue and then holds one more item, blocked on the full queue: once it is
        # seen waiting in the queue's put with the queue full, it cannot read on, so the count is final.
        def blocked(prefetcher=prefetcher, source=source, depth=depth):
            return (source.produced > depth and prefetcher._items.full()
                    and waiting_in(prefetcher._thread, "put"))  # fmt: skip

        assert wait_until(blocked)
        assert source.produced == depth + 1
        assert next(prefetcher) == 0
        assert prefetcher.stop() is True


def test_worker_error_is_reraised_in_the_consumer_as_the_same_object():
    baseline = threading.active_count()
    source = GatedSource(range(10), fail_at=3)
    prefetcher = Prefetcher(source)
    got = [next(prefetcher) for _ in range(3)]
    with pytest.raises(KeyError, match="bad sample") as caught:
        next(prefetcher)
    assert got == [0, 1, 2]
    assert "__next__" in "".join(str(entry.name) for entry in caught.traceback)  # the worker's frame is kept
    assert next(prefetcher, "end") == "end"  # raised once, then the iterator is finished
    assert source.closed and threading.active_count() == baseline


def test_transform_runs_on_the_worker_and_its_errors_reach_the_consumer():
    seen = []

    def double(item):
        seen.append(threading.current_thread().name)
        return item * 2

    assert list(Prefetcher(GatedSource(range(4)), transform=double)) == [0, 2, 4, 6]
    assert set(seen) == {"fntrain-prefetch"}

    def broken(item):
        raise ValueError(f"cannot pin {item}")

    with pytest.raises(ValueError, match="cannot pin 0"):
        next(Prefetcher(GatedSource(range(4)), transform=broken))


def test_stop_unblocks_a_worker_stuck_on_a_full_queue():
    source = GatedSource(range(1000))
    prefetcher = Prefetcher(source, depth=1)
    assert wait_until(lambda: source.produced == 2)  # one queued, one held by a worker blocked on put()
    started = time.monotonic()
    assert prefetcher.stop(timeout=5.0) is True
    assert time.monotonic() - started < 1.0
    assert not prefetcher.alive and source.closed
    assert source.produced == 2
    assert next(prefetcher, "end") == "end"
    assert prefetcher.stop() is True  # idempotent


def test_stop_from_another_thread_releases_a_blocked_consumer():
    gate = threading.Event()
    source = GatedSource(range(3), gate=gate)
    prefetcher = Prefetcher(source)
    outcome = []
    consumer = threading.Thread(target=lambda: outcome.append(next(prefetcher, "ended")))
    consumer.start()
    assert source.entered.wait(2.0)
    assert wait_until(lambda: waiting_in(consumer, "get"))  # the consumer waits on the empty queue
    stopper = threading.Thread(target=lambda: outcome.append(prefetcher.stop(timeout=0.2)))
    with pytest.warns(RuntimeWarning, match="did not stop within"):
        stopper.start()
        stopper.join()
    consumer.join(2.0)
    assert not consumer.is_alive()
    assert "ended" in outcome and False in outcome  # consumer released; the worker was still inside next()
    gate.set()
    assert wait_until(lambda: source.closed)


def test_stop_timeout_returns_false_then_drops_the_late_item_and_releases_everything():
    gate = threading.Event()
    source = GatedSource(["late"], gate=gate)
    prefetcher = Prefetcher(source)
    assert source.entered.wait(2.0)
    with pytest.warns(RuntimeWarning, match="did not stop within 0.1 s"):
        assert prefetcher.stop(timeout=0.1) is False
    threads = prefetch_threads()
    assert threads and threads[0].daemon  # a stuck worker never holds the interpreter open
    gate.set()  # the source returns its item after the stop request
    assert wait_until(lambda: not prefetch_threads())
    assert source.produced == 1 and source.closed
    assert next(prefetcher, "end") == "end"  # the late item was dropped, never delivered
    assert prefetcher._items.empty()


def test_the_stop_timeout_warning_points_at_the_caller_of_stop():
    gate = threading.Event()
    source = GatedSource(["late"], gate=gate)
    prefetcher = Prefetcher(source)
    assert source.entered.wait(2.0)
    with pytest.warns(RuntimeWarning, match="did not stop within") as warned:
        prefetcher.stop(timeout=0.05)
    assert [w.filename for w in warned] == [__file__]
    gate.set()
    assert wait_until(lambda: source.closed)


def test_references_to_the_source_are_released_once_the_worker_exits():
    source = GatedSource(range(5))
    ref = weakref.ref(source)
    prefetcher = Prefetcher(source, depth=2)
    assert next(prefetcher) == 0
    del source
    assert prefetcher.stop() is True
    gc.collect()
    assert ref() is None


def test_stop_before_the_first_item_and_as_context_manager():
    baseline = threading.active_count()
    source = GatedSource(range(5))
    with Prefetcher(source) as prefetcher:
        pass
    assert source.closed and not prefetcher.alive
    assert threading.active_count() == baseline
    prefetcher = Prefetcher(GatedSource([]))
    assert list(prefetcher) == []


def test_a_dropped_prefetcher_stops_its_worker():
    source = GatedSource(range(1000))
    prefetcher = Prefetcher(source)
    assert wait_until(lambda: source.produced == 2)
    del prefetcher
    gc.collect()
    assert wait_until(lambda: source.closed)
    assert wait_until(lambda: not prefetch_threads())


def test_depth_is_validated():
    with pytest.raises(ValueError, match="prefetch depth must be an int >= 1, got 0"):
        Prefetcher(iter([]), depth=0)
