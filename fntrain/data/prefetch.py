"""`Prefetcher`: one background thread that reads an iterator ahead into a bounded queue [S16].

The trainer thread consumes items in order; the worker only ever runs ahead by `depth` items, so
what item k is never depends on prefetching, and the resume position stays that of the last item the
trainer *consumed* (the cursor lives in `TrainState`, never here).

Contract:
- a worker exception is re-raised in the consuming thread (the same exception object), once;
- the source running out is a normal end (`StopIteration`);
- `stop(timeout=5.0)` asks the worker to stop, drains the queue (unblocking a worker stuck on a full
  queue), joins it, drops any item the worker fetched after the request, closes the source in the
  worker's own thread and releases every reference to it. It returns True on a clean stop, False with a
  warning when the worker is still inside the source after `timeout` (it exits and closes the source as
  soon as the source returns; the thread is a daemon so it never holds the interpreter open).
- `close()` is `stop()`: the loop closes each epoch's iterator at epoch end, on `StopTraining` and on
  abort, so no prefetch thread outlives `train`.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Prefetcher"]

log = logging.getLogger("fntrain.data.prefetch")

_END = object()
_POLL_S = 0.05  # how often a blocked put/get re-checks for a stop request or a dead worker


class _Failure:
    """An exception raised in the worker, carried to the consumer."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _close_source(source: Any) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        try:
            close()
        except Exception as error:  # noqa: BLE001 - a failing close must not mask how the worker ended
            log.error("closing the prefetch source raised: %r", error)


def _put(items: queue.Queue, stop: threading.Event, item: Any) -> bool:
    """Put `item` unless a stop is requested while the queue is full; True when it was queued."""
    while not stop.is_set():
        try:
            items.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _fill(
    source: Iterator[Any], items: queue.Queue, stop: threading.Event, transform: Callable[[Any], Any] | None
) -> None:
    """The worker: read `source` into `items` until it ends, fails or a stop is requested.

    A module function holding only locals, so once it returns nothing keeps the source alive.
    """
    try:
        while not stop.is_set():
            try:
                item = next(source)
                if transform is not None:
                    item = transform(item)
            except StopIteration:
                _put(items, stop, _END)
                return
            except BaseException as error:  # noqa: BLE001 - carried to the consumer and re-raised there
                _put(items, stop, _Failure(error))
                return
            if stop.is_set():
                return  # fetched after the stop request: dropped
            if not _put(items, stop, item):
                return
            del item
    finally:
        _close_source(source)


class Prefetcher:
    """Iterate `source` on a daemon thread, at most `depth` items ahead of the consumer.

    `transform` (optional) runs on each item in the worker thread (e.g. pinning host memory). The thread
    starts on construction; `stop()` / `close()` end it. Usable as a context manager.
    """

    def __init__(
        self,
        source: Iterator[Any],
        depth: int = 1,
        *,
        transform: Callable[[Any], Any] | None = None,
        name: str = "fntrain-prefetch",
    ):
        if type(depth) is not int or depth < 1:
            raise ValueError(f"prefetch depth must be an int >= 1, got {depth!r}")
        self._items: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._source: Iterator[Any] | None = source
        self._thread: threading.Thread | None = threading.Thread(
            target=_fill, args=(source, self._items, self._stop, transform), name=name, daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._items.get(timeout=_POLL_S)
                break
            except queue.Empty:
                thread = self._thread
                if thread is None or (not thread.is_alive() and self._items.empty()):
                    # Only a stop request ends the worker without posting an end marker.
                    self._finish()
                    raise StopIteration from None
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Failure):
            error = item.error
            del item
            self._finish()
            raise error
        return item

    def _finish(self) -> None:
        """The worker has posted its last item: join it (it is returning) and release everything."""
        self._finished = True
        self.stop()

    @property
    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the worker and release the source; True on a clean stop, False (and a warning) on timeout.

        Idempotent; safe to call from the consuming thread at any time, including before the first item.
        """
        self._stop.set()
        self._finished = True
        thread = self._thread
        clean = True
        if thread is not None:
            self._drain()  # frees a slot for a worker blocked on a full queue
            thread.join(timeout)
            clean = not thread.is_alive()
            if not clean:
                warnings.warn(
                    f"the prefetch thread {thread.name!r} did not stop within {timeout:g} s (it is still inside "
                    "the data source); it will exit and close the source when the source returns",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._drain()  # an item queued between the first drain and the join
        self._thread = None
        self._source = None
        return clean

    def close(self) -> None:
        """The iterator protocol's close: stop the worker (see `stop`)."""
        self.stop()

    def _drain(self) -> None:
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        # A prefetcher dropped without close(): ask the worker to stop, without joining in a finalizer.
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
