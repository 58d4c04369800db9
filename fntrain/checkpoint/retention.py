"""Retention: which checkpoints may go. A checkpoint is deleted (or counted toward keep_last) only
once it verifies against its manifest; a damaged one is moved aside, one without a manifest is kept.

    remove_superseded_temporary(root, newest)   time-based temporary checkpoints a newer one replaced
    retain(root, keep_last, ...)                keep the newest keep_last verified checkpoints (and, with
                                                keep_best, the one of the lowest val_loss in its meta.json)

Only the caller's one process deletes (rank 0 of a run); every deletion is one log line naming the
checkpoint and why it went.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

from fntrain.checkpoint.layout import is_complete, is_temporary, list_checkpoints, move_aside, step_of
from fntrain.checkpoint.verify import damage, verified

__all__ = ["remove_superseded_temporary", "retain", "val_loss_of"]

log = logging.getLogger("fntrain.checkpoint")


def _deletable(path: Path, why: str) -> bool:
    """Whether `path` verifies against its manifest, so that it may be deleted. A damaged checkpoint is
    moved aside (`.damaged`) with a warning; one without a manifest is left alone. Never raises."""
    try:
        status = verified(path)
    except Exception as error:  # noqa: BLE001 - when in doubt, keep the data
        log.warning("could not verify checkpoint %s (%r); keeping it", path, error)
        return False
    if status is True:
        return True
    if status is None:
        log.info("checkpoint %s has no manifest (saved by an older fntrain): not %s", path, why)
        return False
    problem = damage(path)
    try:
        moved = move_aside(path, "damaged")
    except OSError as error:
        log.warning("checkpoint %s is damaged (%s); not %s, and it could not be moved aside: %r",
                    path, problem, why, error)  # fmt: skip
        return False
    log.warning("checkpoint %s is damaged (%s); not %s, moved aside to %s", path, problem, why, moved.name)
    return False


def remove_superseded_temporary(root: str | os.PathLike, newest: str | os.PathLike) -> list[Path]:
    """Delete the complete temporary checkpoints under `root` with a step below `newest`'s (the
    checkpoint just completed, never removed itself); return what was removed. Only checkpoints that
    verify are deleted (see the module docstring)."""
    newest = Path(newest)
    newest_step = step_of(newest)
    if newest_step is None or not is_complete(newest):
        return []
    superseded = [
        path
        for path in list_checkpoints(root)
        if path != newest and (step_of(path) or 0) < newest_step and is_temporary(path)
    ]
    doomed = [path for path in superseded if _deletable(path, "deleted")]
    return [path for path in doomed if _remove(path, "temporary checkpoint", f"superseded by {newest.name}")]


def retain(
    root: str | os.PathLike, keep_last: int, *, protect: str | os.PathLike | None = None, keep_best: bool = False
) -> list[Path]:
    """Delete all but the newest `keep_last` verified checkpoints (0 keeps all); return what was removed.

    Only checkpoints that verify against their manifest count toward `keep_last`, and only those are
    deleted: a damaged one is moved aside (`.damaged`), one without a manifest is left alone.
    `protect` (the checkpoint just saved, which `latest` names) is never removed, even when checkpoints
    with higher steps exist (left by an earlier run that went further before this one resumed from an
    older step). `keep_best` also keeps the verified checkpoint whose meta.json records the lowest finite
    `val_loss` (the validation loss evaluated at its step). Partial directories are left alone here: one
    may be an asynchronous save in flight.
    """
    if keep_last <= 0:
        return []
    protect = Path(protect) if protect is not None else None
    kept, doomed, counted = 0, [], []
    for path in reversed(list_checkpoints(root)):  # newest first
        if path == protect:
            kept += 1  # written and verified just now
            counted.append(path)
            continue
        if not _deletable(path, "counted toward keep_last"):
            continue
        counted.append(path)
        if kept < keep_last:
            kept += 1
        else:
            doomed.append(path)
    best = _best(counted) if keep_best else None
    why = f"keep_last={keep_last}: not among the newest {keep_last}"
    if best is not None and best[0] in doomed:  # kept for its loss alone: the deletions say so
        doomed.remove(best[0])
        why += f"; {best[0].name} is kept as the best val_loss, {best[1]:.4g}"
    return [path for path in reversed(doomed) if _remove(path, "old checkpoint", why)]


def val_loss_of(path: Path) -> float | None:
    """The validation loss the checkpoint `path` records (meta.json's `val_loss`: evaluated at its
    step), or None when it records none, or none that is finite. Never raises."""
    try:
        value = json.loads((path / "meta.json").read_text(encoding="utf-8")).get("val_loss")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _best(paths: list[Path]) -> tuple[Path, float] | None:
    """(the checkpoint of `paths` with the lowest recorded val_loss, that loss); the newest of equals."""
    scored = [(loss, path) for path in paths if (loss := val_loss_of(path)) is not None]
    if not scored:
        return None
    loss, path = min(scored, key=lambda item: item[0])  # `paths` are newest first: min keeps the first
    return path, loss


def _remove(path: Path, kind: str, why: str) -> bool:
    """Delete the checkpoint `path` (a `kind`, removed because `why`); True once it is no longer a checkpoint. It is first renamed to
    `<name>.removing` (atomic), so a deletion that fails part-way never leaves a half checkpoint that
    looks whole, and the log says what is left instead of claiming it is gone. Never raises."""
    try:
        doomed = move_aside(path, "removing")
    except OSError as error:
        log.warning("could not remove %s %s (%s): %r; it is kept", kind, path, why, error)
        return False
    try:
        shutil.rmtree(doomed)
    except OSError as error:
        log.warning("%s %s (%s) was only partly deleted: %s is left (%r)", kind, path, why, doomed, error)
        return True
    log.info("removed %s %s (%s)", kind, path, why)
    return True
