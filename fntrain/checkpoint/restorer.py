"""`restore`: put a checkpoint back into live components and hooks, and return the `TrainState` [S36].

`source` is "none", "auto" or "latest" (both need `root`), or a path. "latest" resolves to the
`latest` pointer if it names a complete checkpoint, else the highest complete `step_<N>`, else a fresh
start with a warning; "auto" is the same without the warning (a job restarted by torchrun resumes by
itself, and its first launch starts fresh quietly); a path that does not exist is a
`FileNotFoundError`. Partial checkpoints under `root` (no completion marker) are moved aside first
(`step_<N>.incomplete`), never deleted.

Verified before trusted: the chosen checkpoint's files are checked against its manifest (sizes and
CRC-32, `fntrain.checkpoint.verify`; the ranks share the reading and agree on the answer). With
"latest"/"auto" a damaged checkpoint is skipped with one warning naming the file and the reason, moved
aside (`step_<N>.damaged`), and the next newest is tried (the `latest` pointer is then rewritten to the
one restored); when every candidate is damaged that is a `CheckpointDamagedError`, not a fresh start.
A damaged checkpoint named by path is a `CheckpointDamagedError` (a `ConfigError`: one line, exit 2);
a checkpoint root given as a path means its newest intact checkpoint (damaged ones are skipped with a
warning and left in place). A checkpoint saved before manifests existed is restored with one warning
that its contents are unverified (its DCP metadata, JSON files and data file sizes are still checked).

Model and optimizer are loaded with DCP into the tensors `get_state_dict` gives for the live objects, so
the sharding of this run decides what each rank reads (a checkpoint saved at one world size loads at
another), then handed back with `set_state_dict`. Missing model keys are an error naming them; missing
optimizer state is a warning (the optimizer keeps its fresh state). Nothing is unpickled: DCP's metadata
is read with a restricted unpickler and everything else is JSON.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from fntrain.checkpoint import _dist
from fntrain.checkpoint.layout import (
    DCP_METADATA,
    LATEST,
    MARKER,
    candidates,
    clean_partial,
    move_aside,
    step_of,
    write_latest,
)
from fntrain.checkpoint.matching import check_optional_sections, match_keys
from fntrain.checkpoint.rng import set_rng_state
from fntrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from fntrain.checkpoint.saver import FORMAT_VERSION, app_state
from fntrain.checkpoint.tree import decode_value, rebuild
from fntrain.checkpoint.verify import CheckpointDamagedError, Damage, has_manifest, verify_collectively
from fntrain.config import ConfigError
from fntrain.loop import Hook
from fntrain.state import TrainState
from fntrain.stateful import load_hook_states
from fntrain.step.components import Components

__all__ = ["restore", "resolve_source", "read_meta", "CheckpointDamagedError"]

log = logging.getLogger("fntrain.checkpoint")

NAMED_DAMAGED_HINT = '; restore another checkpoint ("latest" skips damaged ones)'  # after a named one fails


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's meta.json (TrainState, non-tensor state, config, world size, versions)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {meta.get('format')!r}; this fntrain reads {FORMAT_VERSION}"
        )
    return meta


@dataclass(frozen=True)
class _Plan:
    """What rank 0 found for a source: the checkpoints to try in order, whether the user named one
    (then damage is an error), and whether damaged ones may be moved aside (the run's own root)."""

    paths: tuple[Path, ...]
    explicit: bool
    tidy: Path | None  # the root whose damaged checkpoints are moved aside and whose pointer is fixed
    source: str

    def to_text(self) -> str:
        return json.dumps(
            {"paths": [str(p) for p in self.paths], "explicit": self.explicit,
             "tidy": None if self.tidy is None else str(self.tidy), "source": self.source}
        )  # fmt: skip

    @classmethod
    def from_text(cls, text: str) -> _Plan:
        raw = json.loads(text)
        tidy = None if raw["tidy"] is None else Path(raw["tidy"])
        return cls(tuple(Path(p) for p in raw["paths"]), raw["explicit"], tidy, raw["source"])


def _plan_on_rank0(source: str | os.PathLike, root: Path | None) -> _Plan:
    if str(source) in ("latest", "auto"):
        if root is None:
            raise ValueError(f'restore "{source}" needs the checkpoint root directory (root=...)')
        clean_partial(root)
        return _Plan(tuple(candidates(root)), explicit=False, tidy=root, source=str(source))
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if (path / MARKER).is_file():  # complete, or damaged since (verification says which)
        if root is not None:
            clean_partial(root)
        return _Plan((path,), explicit=True, tidy=None, source=str(source))
    if path.is_dir() and step_of(path) is None and ((path / LATEST).exists() or any(path.glob("step_*"))):
        found = candidates(path)  # a checkpoint root given as a path: its newest intact checkpoint
        if found:
            return _Plan(tuple(found), explicit=False, tidy=None, source=str(source))
        raise ValueError(f"checkpoint root {str(path)!r} holds no complete checkpoint")
    missing = [name for name in (DCP_METADATA, MARKER) if not (path / name).is_file()]
    raise ConfigError(
        f"{str(path)!r} is not a complete checkpoint (missing {', '.join(missing)}: an interrupted save?)"
    )


def _skip(problem: Damage, plan: _Plan, next_path: Path | None) -> None:
    """Rank 0: the one warning about a damaged checkpoint that "latest" passes over (moved aside when
    it is in the run's own root)."""
    what = f"trying {next_path.name}" if next_path is not None else "no older checkpoint to try"
    if plan.tidy is not None:
        try:
            moved = move_aside(problem.path, "damaged")
            what = f"moved aside to {moved.name}; {what}"
        except OSError as error:
            what = f"could not move it aside ({error}); {what}"
    log.warning("skipping damaged checkpoint %s (%s)", problem, what)


def _no_checkpoint(plan: _Plan, root: Path | None) -> None:
    """Rank 0: say that there is nothing to restore ("latest" warns, "auto" logs)."""
    aside = sorted(p.name for p in root.glob("step_*.damaged*")) if root is not None and root.is_dir() else []
    note = f" ({len(aside)} damaged checkpoint(s) set aside there: {', '.join(aside)})" if aside else ""
    if plan.source == "latest":
        warnings.warn(f"no complete checkpoint under {root}; starting fresh{note}", stacklevel=4)
    elif aside:
        log.warning("restore auto: no complete checkpoint under %s; starting fresh%s", root, note)
    else:
        log.info("restore auto: no complete checkpoint under %s; starting fresh", root)


def resolve_source(
    source: str | os.PathLike | None, root: str | os.PathLike | None = None, process_group: Any = None
) -> Path | None:
    """The verified checkpoint directory `source` names, or None for a fresh start (same answer on
    every rank; a collective when a process group is initialized).

    Rank 0 sets partial checkpoints under `root` aside and lists the candidates; all ranks verify them
    together (see the module docstring); a `CheckpointDamagedError` when the named one (or every
    candidate) is damaged.
    """
    if source is None or str(source) == "none":
        return None
    root_path = Path(root).expanduser() if root is not None else None
    leader = _dist.rank() == 0
    error: BaseException | None = None
    plan: _Plan | None = None
    if leader:
        try:
            plan = _plan_on_rank0(source, root_path)
        except (FileNotFoundError, ValueError) as caught:
            error = caught
    if _dist.initialized():
        mine = f"error:{error}" if error is not None else plan.to_text() if plan is not None else None
        answer = _dist.broadcast_text(mine, process_group)
        assert answer is not None
        if error is None and answer.startswith("error:"):
            raise RuntimeError(f"rank 0 could not resolve checkpoint {str(source)!r}: {answer[6:]}")
        if error is None:
            plan = _Plan.from_text(answer)
    if error is not None:
        raise error
    assert plan is not None

    skipped: list[Damage] = []
    for index, path in enumerate(plan.paths):
        problem = verify_collectively(path, process_group)
        if problem is None:
            if leader and skipped and plan.tidy is not None:
                write_latest(plan.tidy, path)  # the pointer named a checkpoint now set aside
            if leader and not has_manifest(path):
                log.warning(
                    "checkpoint %s has no manifest (saved by an older fntrain): its file sizes and metadata "
                    "were checked, its contents could not be verified", path,
                )  # fmt: skip
            return path
        if plan.explicit:
            raise CheckpointDamagedError(problem, NAMED_DAMAGED_HINT)
        skipped.append(problem)
        if leader:
            _skip(problem, plan, plan.paths[index + 1] if index + 1 < len(plan.paths) else None)
    if skipped:
        raise CheckpointDamagedError(
            skipped[0], f"; no intact checkpoint to restore ({len(skipped)} damaged)"
        )
    if leader:
        _no_checkpoint(plan, plan.tidy)
    return None


def _rank_file(path: Path, rank: int) -> dict[str, Any] | None:
    file = path / f"rank_{rank}.json"
    return json.loads(file.read_text()) if file.is_file() else None


def restore(
    source: str | os.PathLike | None,
    components: Components,
    *,
    root: str | os.PathLike | None = None,
    hooks: Iterable[Hook] | Callable[[], Iterable[Hook]] = (),
    weights_only: bool = False,
    device: torch.device | str | None = None,
    model_part: bool = False,
    verified: bool = False,
) -> TrainState:
    """Restore `source` ("none" | "auto" | "latest" | a path) into `components` and `hooks`; return its
    TrainState. `model_part`: the model is one pipeline stage of the saved one. `verified`: `source` is
    a checkpoint `resolve_source` already verified (its files are not read twice).

    weights_only: load the model weights alone and return a fresh `TrainState()` (optimizer, schedulers,
    RNG and hook states keep their fresh values). Every rank must call this (it is a collective over
    the default process group).
    """
    path = Path(source) if verified else resolve_source(source, root)
    if path is None:
        return TrainState()
    meta = read_meta(path)
    metadata = read_dcp_metadata(path).state_dict_metadata
    optimizers = tuple(components.optimizers)
    stateless = [not optimizer.state for optimizer in optimizers]  # app_state initialises these
    live = app_state(components, weights_only=weights_only)
    saved_values = {tuple(entry[0]): decode_value(entry[1]) for entry in meta["values"]}
    match = match_keys(path, live, metadata, meta.get("tied", []), model_part)

    skip: set[str] = set()
    if not weights_only:
        skip = check_optional_sections(
            path, live, metadata, saved_values, match.missing, match.sections, meta.get("tied", [])
        )
    if "optimizer" in skip:
        # Starting fresh means no state at all: the zero-lr initialisation would otherwise count as a step.
        for optimizer, was_stateless in zip(optimizers, stateless, strict=True):
            if was_stateless:
                optimizer.state.clear()
    to_load = {
        match.aliased.get(key, key): leaf
        for key, leaf in match.live_tensors.items()
        if key not in match.missing and match.sections[key] not in skip
    }
    _load_tensors(path, to_load)
    state_tree = _set_live_state(components, optimizers, live, saved_values, skip, weights_only)
    if weights_only:
        log.info("restored model weights from %s (weights only; training starts at step 0)", path)
        return TrainState()

    _load_schedulers_and_scaler(components, state_tree, skip)
    _restore_rank_state(path, meta, hooks, components, device)
    state = TrainState(**meta["train_state"])
    log.info("restored checkpoint %s (epoch %d, step %d, cursor %d)", path, state.epoch, state.global_step,
             state.cursor)  # fmt: skip
    return state


def _load_tensors(path: Path, to_load: dict[str, torch.Tensor]) -> None:
    """Read `to_load`'s tensors from the checkpoint with DCP, in place (nothing to do when empty)."""
    if not to_load:
        return
    with _dist.quiet_single_process():
        dcp.load(
            to_load,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
            no_dist=not _dist.initialized(),
        )


def _set_live_state(
    components: Components,
    optimizers: tuple[torch.optim.Optimizer, ...],
    live: dict[str, Any],
    saved_values: dict[tuple[Any, ...], Any],
    skip: set[str],
    weights_only: bool,
) -> dict[str, Any]:
    """The live state tree with the loaded tensors and the saved non-tensor values, handed back to the
    model (and the optimizers unless skipped) with `set_state_dict`; returns that tree."""

    def merged(tree_path: tuple[Any, ...], leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) or tree_path not in saved_values:
            return leaf  # tensors were loaded in place (or keep their fresh values)
        if tree_path[:2] == ("optimizer", "param_groups") and tree_path[3:4] == ("params",):
            return leaf  # group members checked equal (`_same_groups`); meta.json lists rank 0's stage only
        return saved_values[tree_path]

    state_tree = rebuild(live, merged)
    if weights_only or "optimizer" in skip or "optimizer" not in state_tree:
        set_model_state_dict(components.model, state_tree["model"])
    else:
        set_state_dict(
            components.model,
            optimizers,
            model_state_dict=state_tree["model"],
            optim_state_dict=state_tree["optimizer"],
        )
    return state_tree


def _load_schedulers_and_scaler(components: Components, state_tree: dict[str, Any], skip: set[str]) -> None:
    """The LR schedulers' and the grad scaler's saved states, unless skipped (the first min of both
    scheduler lists)."""
    if "schedulers" not in skip:
        for scheduler, scheduler_state in zip(
            components.schedulers, state_tree.get("schedulers", ()), strict=False
        ):
            scheduler.load_state_dict(scheduler_state)
    if components.grad_scaler is not None and "grad_scaler" not in skip:
        components.grad_scaler.load_state_dict(state_tree["grad_scaler"])


def _restore_rank_state(
    path: Path,
    meta: dict[str, Any],
    hooks: Iterable[Hook] | Callable[[], Iterable[Hook]],
    components: Components,
    device: torch.device | str | None,
) -> None:
    """This rank's RNG states and hook states (rank 0's hook states when the checkpoint has no file for it)."""
    rank, world = _dist.rank(), _dist.world_size()
    saved_world = meta.get("world_size", 1)
    if saved_world != world:
        log.warning("checkpoint %s was saved by %d rank(s), restoring on %d", path, saved_world, world)
    threads = meta.get("num_threads")
    if threads is not None and threads != torch.get_num_threads():
        log.warning(
            "checkpoint %s was saved with torch.get_num_threads() == %d, this process has %d: CPU results "
            "may differ from an uninterrupted run in the last bits", path, threads, torch.get_num_threads(),
        )  # fmt: skip
    own = _rank_file(path, rank)
    if own is None:
        log.warning("checkpoint %s has no RNG state for rank %d; its RNG keeps the seeded state", path, rank)
    else:
        if device is None:
            device = next((p.device for p in components.model.parameters()), torch.device("cpu"))
        set_rng_state(own["rng"], device)
    hook_source = own if own is not None else _rank_file(path, 0)
    hook_list = list(hooks() if callable(hooks) else hooks)
    missing = load_hook_states(hook_list, hook_source["hooks"] if hook_source else {})
    if missing:
        log.warning("checkpoint %s has no state for hook(s) %s; they start fresh", path, ", ".join(missing))
