"""Behaviours of the prefetch thread that mutation testing found unpinned (mutation/RESULTS.md): a source
read to its end (with or without a close method) ends the worker without an error of its own; a consumer
slower than the worker still gets every item; a failing close is logged, word for word, without masking how
the worker ended; stop() gives a stuck worker 5 s by default and says so in a warning naming the thread,
frees the batches read ahead, and a finished prefetcher answers next() at once; a rejected depth leaves no
half-built prefetcher complaining in its finalizer."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import weakref

import pytest

from fntrain.data.prefetch import Prefetcher
from tests.data.test_prefetch import GatedSource
from tests.helpers.waiting import wait_until


@pytest.fixture
def thread_errors(monkeypatch):
    """The exceptions that escape any thread during the test (pytest would only warn about them)."""
    caught: list[str] = []
    monkeypatch.setattr(
        threading, "excepthook", lambda args: caught.append(f"{args.thread.name}: {args.exc_value!r}")
    )
    return caught


class FailingClose(GatedSource):
    def close(self):
        raise RuntimeError("disk gone")


class Batch:
    """A stand-in for a batch that a weak reference can watch."""

    def __init__(self, index: int):
        self.index = index


@pytest.mark.parametrize("make", [lambda: GatedSource(range(5)), lambda: iter(range(5)), lambda: (i for i in range(5))],
                         ids=["closable", "plain-iterator", "generator"])  # fmt: skip
def test_a_source_read_to_its_end_ends_the_worker_without_an_error(make, thread_errors):
    prefetcher = Prefetcher(make())
    assert list(prefetcher) == [0, 1, 2, 3, 4]
    assert not prefetcher.alive
    assert thread_errors == []


def test_a_consumer_slower_than_the_worker_still_gets_every_item():
    source = GatedSource(range(3))
    prefetcher = Prefetcher(source, depth=1)
    assert wait_until(lambda: source.produced == 2)  # one queued, one held by the worker on the full queue
    time.sleep(0.3)  # the consumer is busy (a long step) while the queue stays full
    assert list(prefetcher) == [0, 1, 2]
    assert source.closed


@pytest.mark.parametrize("fail_at, delivered, raised", [(None, [0, 1, 2], None), (2, [0, 1], KeyError)],
                         ids=["source-ends", "source-fails"])  # fmt: skip
def test_a_failing_close_is_logged_and_the_end_stays_what_it_was(
    fail_at, delivered, raised, caplog, thread_errors
):
    prefetcher = Prefetcher(FailingClose(range(3), fail_at=fail_at))
    got = []
    with caplog.at_level(logging.ERROR, logger="fntrain.data.prefetch"):
        if raised is None:
            got.extend(prefetcher)
        else:
            with pytest.raises(raised, match="bad sample"):
                got.extend(prefetcher)
    assert got == delivered
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "fntrain.data.prefetch",
            logging.ERROR,
            "closing the prefetch source raised: RuntimeError('disk gone')",
        )
    ]
    assert thread_errors == []


@pytest.mark.parametrize("kwargs, shown", [({}, "5"), ({"timeout": 0.25}, "0.25")], ids=["default", "given"])
def test_stop_waits_5_s_by_default_for_a_stuck_worker_and_says_so(kwargs, shown, monkeypatch):
    gate = threading.Event()
    source = GatedSource(["late"], gate=gate)
    prefetcher = Prefetcher(source, name="fntrain-prefetch-pin")
    assert source.entered.wait(2.0)
    waited = []
    with monkeypatch.context() as patch:
        # the wait runs out at once (no test waits 5 s); what stop() asked for is recorded
        patch.setattr(threading.Thread, "join", lambda thread, timeout=None: waited.append(timeout))
        with pytest.warns(RuntimeWarning) as warned:
            assert prefetcher.stop(**kwargs) is False
    assert waited == [float(shown)]
    assert [str(w.message) for w in warned] == [
        f"the prefetch thread 'fntrain-prefetch-pin' did not stop within {shown} s (it is still inside the data "
        "source); it will exit and close the source when the source returns"
    ]
    gate.set()
    assert wait_until(lambda: source.closed)


def test_stop_frees_the_batches_read_ahead():
    refs = []

    def batches():
        for index in range(100):
            batch = Batch(index)
            refs.append(weakref.ref(batch))
            yield batch

    prefetcher = Prefetcher(batches(), depth=2)
    assert wait_until(lambda: len(refs) == 3)  # two queued, one held by the worker on the full queue
    assert prefetcher.stop() is True
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]  # the prefetcher lives on; its batches do not


@pytest.mark.parametrize("finish", [list, Prefetcher.stop], ids=["read-to-end", "stopped"])
def test_a_finished_prefetcher_answers_next_at_once(finish):
    prefetcher = Prefetcher(GatedSource(range(3)))
    finish(prefetcher)
    started = time.monotonic()
    assert [next(prefetcher, "end") for _ in range(20)] == ["end"] * 20
    assert time.monotonic() - started < 0.5  # no waiting on a queue nobody fills any more


@pytest.mark.parametrize("depth", [0, -1, 2.0, True, "2"])
def test_a_rejected_depth_leaves_nothing_behind(depth, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: unraisable.append(repr(args.exc_value)))
    with pytest.raises(ValueError, match=rf"^prefetch depth must be an int >= 1, got {depth!r}$"):
        Prefetcher(iter([]), depth=depth)
    gc.collect()
    assert unraisable == []  # no "Exception ignored in ... __del__" on stderr
