"""`save_async`: a checkpoint staged synchronously (copied off the live tensors) and written by DCP in a
background thread; the same files, order and failures as `fntrain.checkpoint.saver.save`.

As soon as the background write succeeds, rank 0 completes the checkpoint from DCP's thread (manifest,
marker, `latest`, retention: `fntrain.checkpoint.saver.finalize`). A failure of the background write
or of its completion is a `CheckpointSaveError` from `PendingSave.result()`.

Threads: each `save_async` runs its write in an executor thread DCP starts; `PendingSave.result()` /
`stop()` join it once the save finished, and `close_async_saves()` (also called by the `close()` of a
stager from `make_stager`) joins any that is left, so a run that closes its stager ends with no thread
the checkpoint started.

Forks wait for the writes: a process forked while a write runs (a DataLoader worker at the next epoch's
start) inherits whatever C library lock the writer held at that instant. A first save initializes C++
statics in the writer thread, registering their destructors under glibc's exit-function lock; a
worker forked then hangs in its first torch call (`torch.set_num_threads` at its start, pytorch#130610)
and the run with it. So `os.fork` first joins this process's write threads (`_before_fork`, registered
once at import). A fork at an epoch's start then waits for the write in flight, if any.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from fntrain.checkpoint import _dist
from fntrain.checkpoint.saver import Prepared, SaveOptions, SaveTarget, finalize, prepare, writer
from fntrain.checkpoint.space import CheckpointSaveError, save_failure, what_failed
from fntrain.state import TrainState

__all__ = ["save_async", "make_stager", "PendingSave", "close_async_saves"]

log = logging.getLogger("fntrain.checkpoint")

_EXECUTOR_THREAD = "AsyncCheckpointExecutor"  # the name prefix of DCP's async-save executor threads
_JOIN_TIMEOUT_S = 10.0  # an executor thread ends within milliseconds of its save; this is a backstop

_threads_lock = threading.Lock()
_threads: list[threading.Thread] = []  # executor threads of async saves, until joined


class PendingSave:
    """An asynchronous save in flight (owns DCP's future).

    As soon as the background write succeeds, rank 0 completes the checkpoint from DCP's thread (marker,
    then `latest`, then retention), so a crash later in the run does not lose a checkpoint that was fully
    written. `done()` never blocks; `result()` waits and returns the directory, or raises if the write
    or its completion failed; `stop(timeout)` is for abort paths: it waits at most `timeout` seconds
    and never raises.
    """

    def __init__(
        self,
        prepared: Prepared,
        state: TrainState,
        options: SaveOptions,
        future: Future,
        threads: Iterable[threading.Thread] = (),
    ):
        self.root, self.path, self.state = Path(prepared.root), prepared.path, state
        self.keep_last, self.temporary, self.needed = options.keep_last, options.temporary, prepared.needed
        self.keep_best = options.keep_best
        self._threads = tuple(threads)
        self._finished = threading.Event()
        self._error: BaseException | None = None
        future.add_done_callback(self._complete)

    def _complete(self, future: Future) -> None:
        """Runs once the write has finished, in DCP's thread (or at once if it already had). A failed
        write or completion becomes a `CheckpointSaveError` (rank 0 removes the partial directory)."""
        try:
            failure = future.exception()
            problem = what_failed(failure) if failure is not None else None
            if problem is None:
                problem = finalize(self.root, self.path, self.state, self.keep_last, self.temporary,
                                   self.keep_best)
            if problem is not None:
                self._error = save_failure(self.root, self.path, self.state.global_step, problem,
                                           needed=self.needed, discard=_dist.rank() == 0)  # fmt: skip
                self._error.__cause__ = failure
        except BaseException as error:  # noqa: BLE001 - kept for result() to raise in the caller's thread
            self._error = error
        finally:
            self._finished.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write and its completion finished (or `timeout` passed); True when they have.
        Never raises: `result()` says how it went."""
        return self._finished.wait(timeout)

    def done(self) -> bool:
        """True once the write and its completion have finished (successfully or not); never blocks."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Path:
        if not self._finished.wait(timeout):
            raise FutureTimeout(
                f"asynchronous checkpoint save to {self.path} still running after {timeout} s"
            )
        _join(self._threads, _JOIN_TIMEOUT_S)  # the executor ends right after the save's callbacks
        if self._error is not None:
            raise self._error
        return self.path

    def stop(self, timeout: float = 60.0) -> bool:
        """Settle without raising: True when the checkpoint ended complete."""
        try:
            self.result(timeout=timeout)
            return True
        except FutureTimeout:
            log.error(
                "asynchronous checkpoint save to %s still running after %.0f s; abandoning it (unless it "
                "completes before the process exits, it stays incomplete and is ignored on restore)",
                self.path, timeout,
            )  # fmt: skip
        except BaseException as error:  # noqa: BLE001 - an abort path must not raise
            if not isinstance(error, CheckpointSaveError):
                error = f"asynchronous checkpoint save to {self.path} failed: {error.__cause__ or error!r}"
            log.error("%s", error)
        return False


def _join(threads: Iterable[threading.Thread], timeout: float) -> list[threading.Thread]:
    """Join `threads` (at most `timeout` seconds in all); forget the ended ones; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = []
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread)
    with _threads_lock:
        _threads[:] = [thread for thread in _threads if thread.is_alive()]
    return alive


def _before_fork() -> None:
    """Runs in the thread that forks, before the fork: wait until no write thread of this process runs
    (see the module's docstring). A write thread that forks does not wait for itself."""
    with _threads_lock:
        running = [thread for thread in _threads if thread.is_alive() and thread is not threading.current_thread()]  # fmt: skip
    if not running:
        return
    started = time.monotonic()
    for thread in running:
        thread.join()
    log.info(
        "a fork waited %.2f s for the background checkpoint write to finish (a process forked during "
        "it can hang)", time.monotonic() - started,
    )  # fmt: skip


os.register_at_fork(before=_before_fork)


def close_async_saves(timeout: float = 5.0) -> bool:
    """Join the executor threads of every `save_async` of this process, waiting at most `timeout`
    seconds in all; True when none is left. A thread still writing (a save abandoned by
    `PendingSave.stop`) is named in a warning and left to finish (the interpreter waits for it at exit).
    """
    with _threads_lock:
        pending = list(_threads)
    alive = _join(pending, timeout)
    if alive:
        log.warning(
            "%d asynchronous checkpoint write(s) still running after %.0f s (%s); not waiting longer",
            len(alive), timeout, ", ".join(thread.name for thread in alive),
        )  # fmt: skip
    return not alive


class _ClosingStager(DefaultStager):
    """A `DefaultStager` whose `close()` also ends the threads of the async saves (`close_async_saves`)."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            close_async_saves()


def make_stager(device: torch.device | str | None = None) -> Any:
    """A DCP stager to reuse across `save_async` calls (close it with `.close()` when the run ends: that
    releases its buffers and joins the async saves' threads, see `close_async_saves`).

    Staging copies the state off the live tensors before `save_async` returns, synchronously, so the
    next optimizer step can never race the write. From an accelerator it copies into pinned host
    buffers with non-blocking copies; the buffers are cached by the stager, so later saves reuse them.
    """
    accelerated = (
        device is not None and torch.device(device).type != "cpu" and torch.accelerator.is_available()
    )
    return _ClosingStager(
        StagingOptions(
            use_pinned_memory=accelerated,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=accelerated,
        )
    )


def save_async(
    target: SaveTarget,
    state: TrainState,
    options: SaveOptions = SaveOptions(),
    *,
    process_group: Any = None,
    stager: Any = None,
) -> PendingSave:
    """Like `save`, but returns once the state is staged (copied off the live tensors); DCP writes in a
    background thread. Settle the returned `PendingSave` before the next save.

    `stager`: one from `make_stager`, reused across saves (else DCP stages into fresh, unpinned memory).
    With a process group, pass a dedicated group (e.g. a gloo group from `dist.new_group`) so the
    background collectives never interleave with training collectives (it must include a CPU backend).
    A save that does not fit, or whose JSON parts fail, raises `CheckpointSaveError` here; a failure
    of the background write is that error from `result()`.
    """
    prepared = prepare(target, state, options, process_group)
    if not _dist.initialized():
        # The write runs in DCP's thread, outside any `catch_warnings` here; the single-process intent
        # is explicit (no_dist), so its warning about assuming it is noise.
        warnings.filterwarnings("ignore", message=_dist.SINGLE_PROCESS_WARNING)
    before = set(threading.enumerate())
    with _dist.quiet_single_process():
        response = dcp.async_save(
            prepared.tensors,
            storage_writer=writer(prepared.path, options.thread_count),
            process_group=process_group,
            no_dist=not _dist.initialized(),
            async_stager=stager,
        )
    # DCP starts one executor thread per async save (and only shuts it down without joining): keep it
    # to join once the save finished.
    started = [
        thread
        for thread in threading.enumerate()
        if thread not in before and thread.name.startswith(_EXECUTOR_THREAD)
    ]
    with _threads_lock:
        _threads.extend(started)
    future = getattr(response, "upload_completion", response)  # AsyncSaveResponse (async staging) or Future
    return PendingSave(prepared, state, options, future, started)
