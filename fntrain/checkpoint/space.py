"""Room for a checkpoint, and the one line a failed save leaves.

    needed_bytes(root, tensors)       what the next save writes: the newest complete checkpoint's size
                                      (from its manifest), else an estimate from the state's tensors
    free_bytes(root)                  free space of the checkpoint filesystem, for this (unprivileged) user
    room_problem(root, tensors)       None, or why the save will not fit (bytes needed and free)
    CheckpointSaveError               a save that failed: the checkpoint, the OS error, bytes needed and
                                      free, the newest good checkpoint that remains
    what_failed(error)                the OS error under an exception (DCP wraps each rank's), in words
    save_failure(root, path, ...)     the error of a failed save, after its partial directory was removed

A failed save leaves no partial directory under a live `step_<N>` name: it is removed (its bytes are
no checkpoint, and on a full disk they are what the next try needs); when it cannot be removed it is
moved aside as `step_<N>.failed`. Nothing here deletes a complete checkpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fntrain.checkpoint.layout import find_latest, move_aside
from fntrain.checkpoint.verify import read_manifest

__all__ = [
    "CheckpointSaveError",
    "needed_bytes",
    "free_bytes",
    "room_problem",
    "save_failure",
    "discard_partial",
    "os_error",
    "what_failed",
    "human_bytes",
]

log = logging.getLogger("fntrain.checkpoint")

# Bytes a save writes besides the tensors: DCP's metadata, the JSON files and the manifest, and each
# tensor's torch.save header (about 1 kB). Generous, so that an estimate errs towards caution.
_OVERHEAD = 64 << 10
_PER_TENSOR = 2 << 10


class CheckpointSaveError(RuntimeError):
    """A checkpoint save that failed (before, during or after DCP's write). `line` says which
    checkpoint, what failed, bytes needed and free, and the newest good checkpoint that remains;
    `step` is the step that was not saved; `__cause__` the original error."""

    def __init__(self, line: str, step: int):
        super().__init__(line)
        self.line, self.step = line, step


def human_bytes(count: int | None) -> str:
    """`count` bytes for a message: "512 B", "3.2 MB", "1.5 GB" (decimal units, as `df -H`)."""
    if count is None:
        return "unknown"
    size = float(count)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{count} B"  # unreachable


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(root: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding `root` (or its nearest existing parent) for an unprivileged
    user (`f_bavail`); None where the platform cannot say."""
    try:
        stats = os.statvfs(_existing(Path(root)))
    except (OSError, AttributeError):
        try:
            return shutil.disk_usage(_existing(Path(root))).free
        except OSError:
            return None
    return stats.f_bavail * stats.f_frsize


def _tensor_bytes(tensors: Mapping[str, Any]) -> int:
    """The bytes of every tensor at its global size (a DTensor counts its whole shape once, so the sum
    is the checkpoint's size whatever the sharding), plus headers."""
    total = 0
    for tensor in tensors.values():
        shape = getattr(tensor, "shape", None)
        if shape is None:
            continue
        numel = 1
        for size in shape:
            numel *= int(size)
        total += numel * tensor.element_size() + _PER_TENSOR
    return total + _OVERHEAD


def _previous_bytes(root: Path) -> int | None:
    """The size of the newest complete checkpoint under `root` (its manifest's file sizes), else None."""
    latest = find_latest(root)
    if latest is None:
        return None
    try:
        manifest = read_manifest(latest)
    except (OSError, ValueError):
        return None
    if not manifest:
        return None
    return sum(int(entry.get("size", 0)) for entry in manifest.get("files", {}).values())


def needed_bytes(root: str | os.PathLike, tensors: Mapping[str, Any]) -> int:
    """What the next save into `root` will write: the size of the previous checkpoint (the same state
    saved again), else, before the first save, the state's tensors at their global size plus headers."""
    previous = _previous_bytes(Path(root))
    return previous if previous is not None else _tensor_bytes(tensors)


def room_problem(root: str | os.PathLike, tensors: Mapping[str, Any]) -> tuple[int, int | None, str | None]:
    """(bytes needed, bytes free, problem): problem is None when the save fits, else a few words."""
    needed, free = needed_bytes(root, tensors), free_bytes(root)
    if free is not None and free < needed:
        return needed, free, "not enough free space"
    return needed, free, None


def os_error(error: BaseException | None) -> OSError | None:
    """The first OSError under `error`: itself, a DCP `CheckpointException`'s per-rank failures, its
    causes and contexts."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, Mapping):
            pending.extend(pair[0] if isinstance(pair, tuple) else pair for pair in failures.values())
        pending.extend([current.__cause__, current.__context__])
    return None


def what_failed(error: BaseException) -> str:
    """What failed, in a few words: the OS error (its errno name, text and file) when there is one."""
    found = os_error(error)
    if found is not None:
        name = errno.errorcode.get(found.errno or 0, "")
        text = found.strerror or str(found)
        where = f": {found.filename}" if found.filename else ""
        return f"{name + ' ' if name else ''}{text}{where}"
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping) and failures:  # DCP: report the first rank's own error
        rank, pair = next(iter(failures.items()))
        inner = pair[0] if isinstance(pair, tuple) else pair
        first = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
        return f"rank {rank}: {type(inner).__name__}: {first}"
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def discard_partial(path: str | os.PathLike) -> str:
    """Remove what a failed save left at `path` (never a complete checkpoint: the caller's save made
    it); when it cannot be removed, move it aside as `<path>.failed`. Returns what happened, in words."""
    path = Path(path)
    if not path.exists():
        return "nothing was left behind"
    shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
        return f"the partial {path.name} was removed"
    try:
        moved = move_aside(path, "failed")
    except OSError as error:
        return f"the partial {path.name} could be neither removed nor moved aside ({error.strerror or error})"
    return f"the partial {path.name} was moved aside to {moved.name}"


def save_failure(
    root: str | os.PathLike, path: str | os.PathLike, step: int, what: str, *,
    needed: int | None = None, discard: bool = True,
) -> CheckpointSaveError:  # fmt: skip
    """The `CheckpointSaveError` of the failed save of `step` into `path` (`what`: `what_failed` of
    the error), its partial directory discarded first when `discard` (rank 0 only): bytes needed and
    free, what was left behind, the newest good checkpoint that remains."""
    left = discard_partial(path) if discard else ""
    free = free_bytes(root)
    good = find_latest(root)
    remains = (
        f"{good.name} is the newest good checkpoint"
        if good is not None
        else "no complete checkpoint exists yet"
    )
    if (
        "ENOSPC" not in what
        and "EDQUOT" not in what
        and needed is not None
        and free is not None
        and free < needed
    ):
        what += " (the filesystem is full)"  # e.g. torch.save's zip writer, which hides the OS error
    room = (
        f"needs ~{human_bytes(needed)}, {human_bytes(free)} free"
        if needed is not None
        else f"{human_bytes(free)} free"
    )
    line = f"checkpoint {Path(path).name} not saved: {what} ({room})"
    line += f"; {left}" if left else ""
    line += f"; {remains} in {root}"
    return CheckpointSaveError(line, step)
