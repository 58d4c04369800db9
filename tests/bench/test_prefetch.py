"""bench/prefetch.py's hand-written baseline reads everything, in order, and ends; and a quick run of the
benchmark gives both rows for each configuration with a ratio interval."""

from __future__ import annotations

import threading

from bench import prefetch


def test_hand_written_prefetch_yields_every_item_in_order_and_its_thread_ends():
    before = set(threading.enumerate())
    assert list(prefetch._thread_prefetch(iter(range(7)))) == list(range(7))
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=5)
        assert not thread.is_alive()


def test_measure_pairs_five_variants_round_by_round():
    timing = prefetch.measure(load_ms=1, compute_ms=1, steps=3, repeats=2)
    assert set(timing.samples) == {
        "prefetch",
        "hand-written prefetch",
        "no prefetch",
        "compute only",
        "load only",
    }
    assert all(len(values) == 2 for values in timing.samples.values())
    assert all(value > 0 for values in timing.samples.values() for value in values)
