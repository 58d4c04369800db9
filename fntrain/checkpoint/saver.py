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

A save that fails [issue 29] (a full disk, a quota, an I/O error, a permission change; in the JSON
parts, DCP's write or the completion) raises `CheckpointSaveError` on every rank together (the ranks
agree on a failure where DCP does not: before its write and after it), one line naming the
checkpoint, the OS error, bytes needed and free and the newest good checkpoint; rank 0 removes the
partial directory (`fntrain.checkpoint.space`). Before anything is written rank 0 compares the free
space with what the save needs (the previous checkpoint's size, else the state's): a save that will not
fit fails at once, one that leaves no room for the next warns. Retention runs only after a save is
complete, so it never deletes a verified checkpoint to make room, unless `make_room` allows it.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from fntrain.checkpoint import _dist
from fntrain.checkpoint.layout import (
    find_latest,
    is_complete,
    move_aside,
    step_dir,
    write_json_atomic,
    write_latest,
    write_marker,
)
from fntrain.checkpoint.retention import remove_superseded_temporary, retain
from fntrain.checkpoint.rng import rng_state
from fntrain.checkpoint.space import (
    CheckpointSaveError,
    human_bytes,
    needed_bytes,
    room_problem,
    save_failure,
    what_failed,
)
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
    "CheckpointSaveError",
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


@dataclass(frozen=True)
class _Prepared:
    """A save under way: its directory, the tensors for DCP, and the bytes it is expected to need."""

    path: Path
    tensors: dict[str, torch.Tensor]
    needed: int


def _room_for(
    root: Path, path: Path, tensors: dict[str, torch.Tensor], keep_last: int, make_room: bool
) -> tuple[int, str | None]:
    """Rank 0, before anything is written: (bytes needed, a problem or None). With `make_room` (and
    keep_last >= 2, so a good checkpoint always remains) a short disk first loses the oldest verified
    checkpoints that retention would delete after this save anyway; otherwise nothing is deleted."""
    needed, free, short = room_problem(root, tensors)
    if short and make_room and keep_last >= 2:
        removed = retain(root, keep_last - 1, protect=find_latest(root))
        if removed:
            log.warning("checkpoint.make_room: removed %s to make room for %s",
                        ", ".join(p.name for p in removed), path.name)  # fmt: skip
        needed, free, short = room_problem(root, tensors)
    if short:
        return needed, f"ENOSPC not enough free space on {_existing_parent(root)} for {path.name}"
    if free is not None and free - needed < needed:
        log.warning(
            "checkpoint filesystem nearly full: %s free, %s needs ~%s; the save after it will not fit "
            "unless space is freed", human_bytes(free), path.name, human_bytes(needed),
        )  # fmt: skip
    return needed, None


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _clear_step_dir(path: Path) -> None:
    """A directory for this step can only be a leftover (a crashed save, or a run resumed from an
    earlier checkpoint that passes this step again), never merged into: a complete one is replaced
    (this run supersedes it), anything else is moved aside, never deleted."""
    if path.exists() and is_complete(path):
        log.info("replacing existing checkpoint directory %s", path)
        shutil.rmtree(path)
    elif path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    elif path.exists():
        moved = move_aside(path, "incomplete")
        log.warning("moved the incomplete checkpoint directory %s aside to %s", path, moved.name)


def _failed(root: str | os.PathLike, path: Path, step: int, what: str | None, needed: int | None) -> None:
    """Raise the `CheckpointSaveError` of `what` (agreed by every rank), rank 0 discarding the partial."""
    if what is not None:
        raise save_failure(root, path, step, what, needed=needed, discard=_dist.rank() == 0)


def _prepare(
    root: str | os.PathLike,
    state: TrainState,
    components: Components,
    hooks: HooksArg,
    config: Mapping[str, Any] | None,
    device: torch.device | str | None,
    process_group: Any,
    temporary: bool = False,
    data: Mapping[str, Any] | None = None,
    keep_last: int = 0,
    make_room: bool = False,
    recipe: str | None = None,
) -> _Prepared:
    """Check the room, make the step directory, write the JSON parts; every rank agrees on a failure
    (a `CheckpointSaveError` on every rank, the partial directory removed)."""
    path = step_dir(root, state.global_step)
    rank, world = _dist.rank(), _dist.world_size()
    tree = app_state(components)
    tensors, values = split(tree)
    needed, problem = needed_bytes(root, tensors), None
    if rank == 0:
        try:
            _clear_step_dir(path)
            needed, problem = _room_for(Path(root), path, tensors, keep_last, make_room)
            if problem is None:
                path.mkdir(parents=True)
        except OSError as error:
            problem = what_failed(error)
    _failed(root, path, state.global_step, _dist.agree(problem, process_group), needed)

    try:
        described = {"recipe": recipe, "data": dict(data) if data is not None else None}
        _write_json_parts(path, state, components, hooks, config, device, temporary, described, tree, values)
        problem = None
    except OSError as error:
        problem = f"rank {rank}: {what_failed(error)}" if world > 1 else what_failed(error)
    _failed(root, path, state.global_step, _dist.agree(problem, process_group), needed)
    return _Prepared(path, tensors, needed)


def _write_json_parts(path: Path, state: TrainState, components: Components, hooks: HooksArg,
                      config: Mapping[str, Any] | None, device: Any, temporary: bool,
                      described: Mapping[str, Any], tree: dict[str, Any], values: Any) -> None:  # fmt: skip
    """This rank's `rank_<r>.json` (RNG, hook states) and, on rank 0, `meta.json` (with `described`:
    the recipe that wrote it and the data's fingerprint)."""
    rank, world = _dist.rank(), _dist.world_size()
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
                **described,
                "torch_version": torch.__version__,
                "num_threads": torch.get_num_threads(),
                "saved_at": time.time(),
                "temporary": temporary,
                "tied": _tied_names(components.model),
            },
        )


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each weight the model holds under several (a tied output head): a pipeline stage
    that holds it under another name than the one its optimizer state was saved under restores it."""
    from fntrain.runtime.pipeline import tied_names

    return tied_names(model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model)


def _writer(path: Path, thread_count: int) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, sync_files=True, thread_count=thread_count)


def _finalize(
    root: str | os.PathLike, path: Path, state: TrainState, keep_last: int, temporary: bool = False
) -> str | None:
    """Rank 0: the manifest (checksums of the written files), the completion marker (only once DCP's
    metadata exists), then `latest`, then the temporary checkpoints it supersedes, then retention.
    Returns what failed before `latest` named the checkpoint (None: it is complete and named); a
    failure of the clean-up after that is a warning, the checkpoint stays."""
    if _dist.rank() != 0:
        return None
    try:
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
    except OSError as error:
        return what_failed(error)
    try:
        remove_superseded_temporary(root, path)
        retain(root, keep_last, protect=path)
    except OSError as error:
        log.warning("checkpoint %s saved, but removing older checkpoints failed: %s", path,
                    what_failed(error))  # fmt: skip
    log.info("checkpoint saved: %s", path)
    return None


# What a failed DCP write raises: DCP's CheckpointException (a BaseException, gathered from every rank,
# raised on every rank alike), or the writer's own error where DCP runs without a process group.
_WRITE_ERRORS = (Exception, CheckpointException)


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
    data: Mapping[str, Any] | None = None,
    make_room: bool = False,
) -> Path:
    """Save `<root>/step_<global_step>/` and return it, complete, on every rank (a collective).

    `hooks` (a list, or a callable returning it) contributes the `state_dict()` of each stateful hook;
    `config` is the resolved run config (JSON-able); `data` the data's fingerprint
    (`fntrain.data.fingerprint`); `keep_last` > 0 deletes older complete checkpoints.
    `temporary`: deleted once a later checkpoint is complete. `recipe` (how
    `fntrain.run.recipes.load_recipe` finds the recipe that wrote it) goes into meta.json, for
    `fntrain export`. Saving before the first optimizer step
    initialises the optimizers' state (see `app_state`).

    A save that does not fit or fails (ENOSPC, EDQUOT, EIO, a permission change; before, inside or
    after DCP's write) raises `CheckpointSaveError` on every rank, with its partial directory removed
    and the newest good checkpoint untouched. `make_room`: see `_room_for`.
    """
    prepared = _prepare(root, state, components, hooks, config, device, process_group, temporary, data,
                        keep_last, make_room, recipe)  # fmt: skip
    path = prepared.path
    try:
        with _dist.quiet_single_process():
            dcp.save(
                prepared.tensors,
                storage_writer=_writer(path, thread_count),
                process_group=process_group,
                no_dist=not _dist.initialized(),
            )
        problem = None
    except _WRITE_ERRORS as error:  # every rank has it (DCP gathers the failures): no agreement needed
        problem = what_failed(error)
    _failed(root, path, state.global_step, problem, prepared.needed)
    problem = _finalize(root, path, state, keep_last, temporary)
    # every rank returns only once the checkpoint is marked complete, or raises with rank 0
    _failed(root, path, state.global_step, _dist.agree(problem, process_group), prepared.needed)
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
        needed: int | None = None,
    ):
        self.root, self.path, self.state, self.keep_last = root, path, state, keep_last
        self.temporary = temporary
        self.needed = needed
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
                problem = _finalize(self.root, self.path, self.state, self.keep_last, self.temporary)
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
    data: Mapping[str, Any] | None = None,
    make_room: bool = False,
) -> PendingSave:
    """Like `save`, but returns once the state is staged (copied off the live tensors); DCP writes in a
    background thread. Settle the returned `PendingSave` before the next save.

    `stager`: one from `make_stager`, reused across saves (else DCP stages into fresh, unpinned memory).
    With a process group, pass a dedicated group (e.g. a gloo group from `dist.new_group`) so the
    background collectives never interleave with training collectives (it must include a CPU backend).
    A save that does not fit, or whose JSON parts fail, raises `CheckpointSaveError` here; a failure
    of the background write is that error from `result()`.
    """
    prepared = _prepare(root, state, components, hooks, config, device, process_group, temporary, data,
                        keep_last, make_room, recipe)  # fmt: skip
    path, tensors = prepared.path, prepared.tensors
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
    return PendingSave(Path(root), path, state, keep_last, future, temporary, started, prepared.needed)
