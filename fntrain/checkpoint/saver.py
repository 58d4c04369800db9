"""`save` / `save_async`: one checkpoint of a run as `<root>/step_<N>/` over torch.distributed.checkpoint.

What is saved [S36]: the model and optimizer state (via `get_state_dict`, so DDP and FSDP2 save sharded
and a checkpoint loads at another world size), LR schedulers, the grad scaler, `TrainState`, every
stateful hook's `state_dict()` and the RNG states (both per rank), and the resolved config. Tensors go to
DCP; everything else is JSON. Nothing is pickled by fntrain.

Order, so that a crash at any point leaves either a complete checkpoint or one that is ignored:
per-rank JSON and meta.json → DCP data → DCP `.metadata` (DCP writes it last) → `manifest.json` (every
file's size and CRC-32, read back from the written files; `fntrain.checkpoint.verify`) → `COMPLETE`
marker → `latest` pointer → retention. Only rank 0 writes the manifest, the marker, the pointer and
deletes old checkpoints (only ones that verify). An async save does the manifest onwards in DCP's
thread, once the background write finished.

Threads: each `save_async` runs its write in an executor thread DCP starts; `PendingSave.result()` /
`stop()` join it once the save finished, and `close_async_saves()` (also called by the `close()` of a
stager from `make_stager`) joins any that is left, so a run that closes its stager ends with no thread
the checkpoint started.

A checkpoint saved with `temporary=True` (time-based saves, optionally) says so in meta.json and in its
`COMPLETE` marker; completing any later checkpoint deletes the temporary ones with a lower step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from fntrain.checkpoint import _dist
from fntrain.checkpoint.layout import (
    is_complete,
    move_aside,
    step_dir,
    write_json_atomic,
    write_latest,
    write_marker,
)
from fntrain.checkpoint.retention import remove_superseded_temporary, retain
from fntrain.checkpoint.rng import rng_state
from fntrain.checkpoint.tree import split
from fntrain.checkpoint.verify import write_manifest
from fntrain.components import Components
from fntrain.loop import Hook
from fntrain.state import TrainState
from fntrain.stateful import hook_states

__all__ = [
    "FORMAT_VERSION",
    "app_state",
    "save",
    "save_async",
    "make_stager",
    "PendingSave",
    "close_async_saves",
]

log = logging.getLogger("fntrain.checkpoint")

FORMAT_VERSION = 1
HooksArg = Iterable[Hook] | Callable[[], Iterable[Hook]]
_EXECUTOR_THREAD = "AsyncCheckpointExecutor"  # the name prefix of DCP's async-save executor threads
_JOIN_TIMEOUT_S = 10.0  # an executor thread ends within milliseconds of its save; this is a backstop

_threads_lock = threading.Lock()
_threads: list[threading.Thread] = []  # executor threads of async saves, until joined


def app_state(components: Components, *, weights_only: bool = False) -> dict[str, Any]:
    """The state tree of `components`: {"model", "optimizer", "schedulers", "grad_scaler"}.

    Model and optimizer come from `get_state_dict` (FQN keys without DDP/FSDP wrappers; DTensor shards
    under FSDP2). On an optimizer without state yet it initialises the state with a zero-lr step, which is
    what lets a fresh optimizer receive a checkpoint's moments. `weights_only` gives the model alone.
    """
    optimizers = tuple(components.optimizers)
    if optimizers and not weights_only:
        model_state, optimizer_state = get_state_dict(components.model, optimizers)
        tree: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    else:
        tree = {"model": get_model_state_dict(components.model)}
    if weights_only:
        return tree
    if components.schedulers:
        tree["schedulers"] = [scheduler.state_dict() for scheduler in components.schedulers]
    if components.grad_scaler is not None:
        tree["grad_scaler"] = components.grad_scaler.state_dict()
    return tree


def _hooks(hooks: HooksArg) -> list[Hook]:
    return list(hooks() if callable(hooks) else hooks)


def _json_hook_states(hooks: list[Hook]) -> dict[str, Any]:
    """`hook_states`, each checked to be JSON (a TypeError names the hook): loading must run no code."""
    states = hook_states(hooks)
    for name, hook_state in states.items():
        try:
            json.dumps(hook_state)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"the state_dict() of hook {name!r} must be JSON data (tensors: .tolist()): {error}"
            ) from None
    return states


def _device_of(components: Components, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for param in components.model.parameters():
        return param.device
    return torch.device("cpu")


def _prepare(
    root: str | os.PathLike,
    state: TrainState,
    components: Components,
    hooks: HooksArg,
    config: Mapping[str, Any] | None,
    device: torch.device | str | None,
    process_group: Any,
    temporary: bool = False,
    recipe: str | None = None,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Make the step directory, write the JSON parts, return (directory, tensors for DCP)."""
    path = step_dir(root, state.global_step)
    rank, world = _dist.rank(), _dist.world_size()
    if rank == 0:
        # A directory for this step can only be a leftover (a crashed save, or a run resumed from an
        # earlier checkpoint that passes this step again), never merged into: a complete one is
        # replaced (this run supersedes it), anything else is moved aside, never deleted.
        if path.exists() and is_complete(path):
            log.info("replacing existing checkpoint directory %s", path)
            shutil.rmtree(path)
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif path.exists():
            moved = move_aside(path, "incomplete")
            log.warning("moved the incomplete checkpoint directory %s aside to %s", path, moved.name)
        path.mkdir(parents=True)
    _dist.barrier(process_group)

    tree = app_state(components)
    tensors, values = split(tree)
    rank_state = {
        "rank": rank,
        "world_size": world,
        "rng": rng_state(_device_of(components, device)),
        "hooks": _json_hook_states(_hooks(hooks)),
    }
    if "optimizer" in tree:  # each pipeline stage's own groups (meta.json's values are rank 0's)
        rank_state["optimizer_groups"] = [
            list(g["params"]) for g in tree["optimizer"].get("param_groups", [])
        ]
    write_json_atomic(path / f"rank_{rank}.json", rank_state)
    if rank == 0:
        write_json_atomic(
            path / "meta.json",
            {
                "format": FORMAT_VERSION,
                "step": state.global_step,
                "train_state": state.as_dict(),
                "world_size": world,
                "values": values,
                "config": dict(config) if config is not None else None,
                "recipe": recipe,
                "torch_version": torch.__version__,
                "num_threads": torch.get_num_threads(),
                "saved_at": time.time(),
                "temporary": temporary,
                "tied": _tied_names(components.model),
            },
        )
    return path, tensors


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each weight the model holds under several (a tied output head): a pipeline stage
    that holds it under another name than the one its optimizer state was saved under restores it."""
    from fntrain.runtime.pipeline import tied_names

    return tied_names(model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model)


def _writer(path: Path, thread_count: int) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, sync_files=True, thread_count=thread_count)


def _finalize(
    root: str | os.PathLike, path: Path, state: TrainState, keep_last: int, temporary: bool = False
) -> None:
    """Rank 0: the manifest (checksums of the written files), the completion marker (only once DCP's
    metadata exists), then `latest`, then the temporary checkpoints it supersedes, then retention."""
    if _dist.rank() != 0:
        return
    write_manifest(path)
    write_marker(
        path,
        {
            "step": state.global_step,
            "train_state": state.as_dict(),
            "completed_at": time.time(),
            "temporary": temporary,
        },
    )
    write_latest(root, path)
    remove_superseded_temporary(root, path)
    retain(root, keep_last, protect=path)
    log.info("checkpoint saved: %s", path)


def save(
    root: str | os.PathLike,
    state: TrainState,
    components: Components,
    *,
    hooks: HooksArg = (),
    config: Mapping[str, Any] | None = None,
    keep_last: int = 0,
    device: torch.device | str | None = None,
    process_group: Any = None,
    thread_count: int = 1,
    temporary: bool = False,
    recipe: str | None = None,
) -> Path:
    """Save `<root>/step_<global_step>/` and return it, complete, on every rank (a collective).

    `hooks` (a list, or a callable returning it) contributes the `state_dict()` of each stateful hook;
    `config` is the resolved run config (JSON-able); `keep_last` > 0 deletes older complete checkpoints.
    `temporary`: deleted once a later checkpoint is complete. `recipe` (how `fntrain.run.recipes.load_recipe`
    finds the recipe that wrote it) goes into meta.json, for `fntrain export`. Saving before the first
    optimizer step
    initialises the optimizers' state (see `app_state`).
    """
    path, tensors = _prepare(root, state, components, hooks, config, device, process_group, temporary, recipe)
    with _dist.quiet_single_process():
        dcp.save(
            tensors,
            storage_writer=_writer(path, thread_count),
            process_group=process_group,
            no_dist=not _dist.initialized(),
        )
    _finalize(root, path, state, keep_last, temporary)
    _dist.barrier(process_group)  # every rank returns only once the checkpoint is marked complete
    return path


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
        root: Path,
        path: Path,
        state: TrainState,
        keep_last: int,
        future: Future,
        temporary: bool = False,
        threads: Iterable[threading.Thread] = (),
    ):
        self.root, self.path, self.state, self.keep_last = root, path, state, keep_last
        self.temporary = temporary
        self._threads = tuple(threads)
        self._finished = threading.Event()
        self._error: BaseException | None = None
        future.add_done_callback(self._complete)

    def _complete(self, future: Future) -> None:
        """Runs once the write has finished, in DCP's thread (or at once if it already had)."""
        try:
            failure = future.exception()
            if failure is None:
                _finalize(self.root, self.path, self.state, self.keep_last, self.temporary)
            else:
                error = RuntimeError(
                    f"asynchronous checkpoint save of step {self.state.global_step} to {self.path} failed"
                )
                error.__cause__ = failure
                self._error = error
        except BaseException as error:  # noqa: BLE001 - kept for result() to raise in the caller's thread
            self._error = error
        finally:
            self._finished.set()

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
            log.error("asynchronous checkpoint save to %s failed: %r", self.path, error.__cause__ or error)
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
    root: str | os.PathLike,
    state: TrainState,
    components: Components,
    *,
    hooks: HooksArg = (),
    config: Mapping[str, Any] | None = None,
    keep_last: int = 0,
    device: torch.device | str | None = None,
    process_group: Any = None,
    thread_count: int = 1,
    stager: Any = None,
    temporary: bool = False,
    recipe: str | None = None,
) -> PendingSave:
    """Like `save`, but returns once the state is staged (copied off the live tensors); DCP writes in a
    background thread. Settle the returned `PendingSave` before the next save.

    `stager`: one from `make_stager`, reused across saves (else DCP stages into fresh, unpinned memory).
    With a process group, pass a dedicated group (e.g. a gloo group from `dist.new_group`) so the
    background collectives never interleave with training collectives (it must include a CPU backend).
    """
    path, tensors = _prepare(root, state, components, hooks, config, device, process_group, temporary, recipe)
    if not _dist.initialized():
        # The write runs in DCP's thread, outside any `catch_warnings` here; the single-process intent
        # is explicit (no_dist), so its warning about assuming it is noise.
        warnings.filterwarnings("ignore", message=_dist.SINGLE_PROCESS_WARNING)
    before = set(threading.enumerate())
    with _dist.quiet_single_process():
        response = dcp.async_save(
            tensors,
            storage_writer=_writer(path, thread_count),
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
    return PendingSave(Path(root), path, state, keep_last, future, temporary, started)
