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

What to save is one `SaveTarget` (fixed for a run: root, components, hooks, run config, recipe, data
fingerprint, device), how one `SaveOptions` (retention, writer threads, temporary, make_room). The
asynchronous save (`save_async`, its threads and stager) is `fntrain.checkpoint.async_save`.

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
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
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
from fntrain.loop import Hook
from fntrain.state import TrainState
from fntrain.stateful import hook_states
from fntrain.step.components import Components

__all__ = ["FORMAT_VERSION", "SaveTarget", "SaveOptions", "app_state", "save", "CheckpointSaveError"]

log = logging.getLogger("fntrain.checkpoint")

FORMAT_VERSION = 1
HooksArg = Iterable[Hook] | Callable[[], Iterable[Hook]]


@dataclass(frozen=True)
class SaveTarget:
    """What a run's checkpoints hold and where they go (the same for every save of a run).

    `root`: checkpoints are `<root>/step_<N>/`; `components`: the model, optimizers, schedulers and
    scaler; `hooks` (a list, or a callable returning it): each stateful hook's `state_dict()`; `config`:
    the resolved run config (JSON-able); `recipe`: how `fntrain.cli.recipes.load_recipe` finds the
    recipe that wrote it (for `fntrain export`); `data`: the data's fingerprint
    (`fntrain.data.fingerprint`); `device`: whose RNG state is saved (None: the model's); `run_dir`: the
    run directory the checkpoints belong to (recorded absolute, so that another run directory does not
    adopt them); `val_loss(step)`: the validation loss evaluated at that step, or None (recorded for
    retention's keep_best).
    """

    root: str | os.PathLike
    components: Components
    hooks: HooksArg = ()
    config: Mapping[str, Any] | None = None
    recipe: str | None = None
    data: Mapping[str, Any] | None = None
    device: torch.device | str | None = None
    run_dir: str | os.PathLike | None = None
    val_loss: Callable[[int], float | None] | None = None


@dataclass(frozen=True)
class SaveOptions:
    """How one save is written: `keep_last` > 0 deletes older complete checkpoints once it is complete
    (`keep_best`: not the one of the lowest recorded val_loss); `thread_count` writer threads per rank;
    `temporary`: deleted once a later checkpoint is complete; `make_room`: see `_room_for`."""

    keep_last: int = 0
    thread_count: int = 1
    temporary: bool = False
    make_room: bool = False
    keep_best: bool = False


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
class Prepared:
    """A save under way: its root and directory, the tensors for DCP, and the bytes it is expected to need."""

    root: str | os.PathLike
    path: Path
    tensors: dict[str, torch.Tensor]
    needed: int


def _room_for(
    root: Path, path: Path, tensors: dict[str, torch.Tensor], options: SaveOptions
) -> tuple[int, str | None]:
    """Rank 0, before anything is written: (bytes needed, a problem or None). With `make_room` (and
    keep_last >= 2, so a good checkpoint always remains) a short disk first loses the oldest verified
    checkpoints that retention would delete after this save anyway; otherwise nothing is deleted."""
    needed, free, short = room_problem(root, tensors)
    if short and options.make_room and options.keep_last >= 2:
        removed = retain(root, options.keep_last - 1, protect=find_latest(root), keep_best=options.keep_best)
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


def raise_if_failed(
    root: str | os.PathLike, path: Path, step: int, what: str | None, needed: int | None
) -> None:
    """Raise the `CheckpointSaveError` of `what` (agreed by every rank), rank 0 discarding the partial."""
    if what is not None:
        raise save_failure(root, path, step, what, needed=needed, discard=_dist.rank() == 0)


def prepare(target: SaveTarget, state: TrainState, options: SaveOptions, process_group: Any) -> Prepared:
    """Check the room, make the step directory, write the JSON parts; every rank agrees on a failure
    (a `CheckpointSaveError` on every rank, the partial directory removed)."""
    root, step = target.root, state.global_step
    path = step_dir(root, step)
    rank, world = _dist.rank(), _dist.world_size()
    tree = app_state(target.components)
    tensors, values = split(tree)
    needed, problem = needed_bytes(root, tensors), None
    if rank == 0:
        try:
            _clear_step_dir(path)
            needed, problem = _room_for(Path(root), path, tensors, options)
            if problem is None:
                path.mkdir(parents=True)
        except OSError as error:
            problem = what_failed(error)
    raise_if_failed(root, path, step, _dist.agree(problem, process_group), needed)

    try:
        _write_json_parts(path, state, target, options.temporary, tree, values)
        problem = None
    except OSError as error:
        problem = f"rank {rank}: {what_failed(error)}" if world > 1 else what_failed(error)
    raise_if_failed(root, path, step, _dist.agree(problem, process_group), needed)
    return Prepared(root, path, tensors, needed)


def _write_json_parts(
    path: Path, state: TrainState, target: SaveTarget, temporary: bool, tree: dict[str, Any], values: Any
) -> None:
    """This rank's `rank_<r>.json` (RNG, hook states) and, on rank 0, `meta.json` (with the recipe that
    wrote it and the data's fingerprint)."""
    rank, world = _dist.rank(), _dist.world_size()
    rank_state = {
        "rank": rank,
        "world_size": world,
        "rng": rng_state(_device_of(target.components, target.device)),
        "hooks": _json_hook_states(_hooks(target.hooks)),
    }
    if "optimizer" in tree:  # each pipeline stage's own groups (meta.json's values are rank 0's)
        rank_state["optimizer_groups"] = [
            list(g["params"]) for g in tree["optimizer"]["param_groups"]
        ]
    write_json_atomic(path / f"rank_{rank}.json", rank_state)
    if rank == 0:
        described = {"recipe": target.recipe, "data": dict(target.data) if target.data is not None else None,
                     "run_dir": _absolute(target.run_dir), "val_loss": _val_loss(target, state.global_step)}
        write_json_atomic(
            path / "meta.json",
            {
                "format": FORMAT_VERSION,
                "step": state.global_step,
                "train_state": state.as_dict(),
                "world_size": world,
                "values": values,
                "config": dict(target.config) if target.config is not None else None,
                **described,
                "torch_version": torch.__version__,
                "num_threads": torch.get_num_threads(),
                "saved_at": time.time(),
                "temporary": temporary,
                "tied": _tied_names(target.components.model),
            },
        )


def _absolute(path: str | os.PathLike | None) -> str | None:
    return os.path.abspath(os.path.expanduser(os.fspath(path))) if path is not None else None


def _val_loss(target: SaveTarget, step: int) -> float | None:
    """The validation loss evaluated at `step` (None: not evaluated there, or not finite)."""
    value = target.val_loss(step) if target.val_loss is not None else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each weight the model holds under several (a tied output head): a pipeline stage
    that holds it under another name than the one its optimizer state was saved under restores it."""
    from fntrain.runtime.pipeline import tied_names

    return tied_names(model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model)


def writer(path: Path, thread_count: int) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, sync_files=True, thread_count=thread_count)


def finalize(
    root: str | os.PathLike, path: Path, state: TrainState, keep_last: int, temporary: bool = False,
    keep_best: bool = False,
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
        retain(root, keep_last, protect=path, keep_best=keep_best)
    except OSError as error:
        log.warning("checkpoint %s saved, but removing older checkpoints failed: %s", path,
                    what_failed(error))  # fmt: skip
    log.info("checkpoint saved: %s", path)
    return None


# What a failed DCP write raises: DCP's CheckpointException (a BaseException, gathered from every rank,
# raised on every rank alike), or the writer's own error where DCP runs without a process group.
_WRITE_ERRORS = (Exception, CheckpointException)


def save(
    target: SaveTarget, state: TrainState, options: SaveOptions = SaveOptions(), *, process_group: Any = None
) -> Path:
    """Save `<target.root>/step_<global_step>/` and return it, complete, on every rank (a collective).

    Saving before the first optimizer step initialises the optimizers' state (see `app_state`).

    A save that does not fit or fails (ENOSPC, EDQUOT, EIO, a permission change; before, inside or
    after DCP's write) raises `CheckpointSaveError` on every rank, with its partial directory removed
    and the newest good checkpoint untouched. `options.make_room`: see `_room_for`.
    """
    prepared = prepare(target, state, options, process_group)
    root, path = target.root, prepared.path
    try:
        with _dist.quiet_single_process():
            dcp.save(
                prepared.tensors,
                storage_writer=writer(path, options.thread_count),
                process_group=process_group,
                no_dist=not _dist.initialized(),
            )
        problem = None
    except _WRITE_ERRORS as error:  # every rank has it (DCP gathers the failures): no agreement needed
        problem = what_failed(error)
    raise_if_failed(root, path, state.global_step, problem, prepared.needed)
    problem = finalize(root, path, state, options.keep_last, options.temporary, options.keep_best)
    # every rank returns only once the checkpoint is marked complete, or raises with rank 0
    raise_if_failed(root, path, state.global_step, _dist.agree(problem, process_group), prepared.needed)
    return path
