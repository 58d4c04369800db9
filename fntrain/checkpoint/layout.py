"""Where checkpoints live on disk and when one counts as complete [S36]. Standard library only.

A checkpoint root holds one `step_<N>/` directory per save and a `latest` pointer file:

    <root>/step_<N>/.metadata        DCP's metadata, written last by DCP itself
    <root>/step_<N>/*.distcp         DCP's tensor data
    <root>/step_<N>/meta.json        TrainState, the non-tensor leaves of the app state, the config (rank 0)
    <root>/step_<N>/rank_<r>.json    per-rank RNG states and hook states
    <root>/step_<N>/COMPLETE         fntrain's completion marker, written only after `.metadata` exists
    <root>/latest                    the name of the newest complete checkpoint (write + os.replace)

A directory is complete only when both `.metadata` and `COMPLETE` exist; anything else is a partial
left by a crash: ignored when resolving "latest" and removed by `clean_partial`. A `COMPLETE` marker
with `"temporary": true` marks a checkpoint to delete once a later one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "DCP_METADATA",
    "MARKER",
    "LATEST",
    "step_dir",
    "step_of",
    "is_complete",
    "list_checkpoints",
    "find_latest",
    "write_json_atomic",
    "write_marker",
    "write_latest",
    "is_temporary",
    "remove_superseded_temporary",
    "retain",
    "clean_partial",
]

log = logging.getLogger("fntrain.checkpoint")

DCP_METADATA = ".metadata"
MARKER = "COMPLETE"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """`<root>/step_<step>`."""
    return Path(root) / f"step_{step}"


def step_of(path: str | os.PathLike) -> int | None:
    """The step number of a `step_<N>` directory name, else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: str | os.PathLike) -> bool:
    """True when `path` holds both DCP's metadata and fntrain's completion marker."""
    path = Path(path)
    return (path / DCP_METADATA).is_file() and (path / MARKER).is_file()


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under `root`, oldest step first."""
    return [path for _, path in _step_dirs(Path(root)) if is_complete(path)]


def find_latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint "latest" means [S36]: the pointer if it names a complete checkpoint, else the
    highest complete one, else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        # Only a bare `step_<N>` name is honoured: a pointer must never lead outside the root.
        if step_of(name) is not None and is_complete(root / name):
            return root / name
        log.warning(
            "checkpoint pointer %s names %r, which is not a complete checkpoint; ignoring it", pointer, name
        )
    complete = list_checkpoints(root)
    return complete[-1] if complete else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """A JSON object to `path`, atomically (write + os.replace)."""
    # One top-level key per line: readable, and long leaf lists stay on one line each.
    lines = [
        f"{json.dumps(key)}: {json.dumps(value, sort_keys=True)}" for key, value in sorted(payload.items())
    ]
    _write_atomic(Path(path), "{\n" + ",\n".join(lines) + "\n}\n")


def write_marker(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Mark `path` complete. Refuses unless DCP's metadata is already there: the marker is the last word."""
    path = Path(path)
    if not (path / DCP_METADATA).is_file():
        raise RuntimeError(f"refusing to mark {path} complete: DCP metadata {DCP_METADATA!r} is missing")
    write_json_atomic(path / MARKER, payload)


def write_latest(root: str | os.PathLike, path: str | os.PathLike) -> None:
    """Point `<root>/latest` at the complete checkpoint `path` (atomically)."""
    path = Path(path)
    if not is_complete(path):
        raise RuntimeError(f"refusing to point {LATEST!r} at {path}: it is not a complete checkpoint")
    _write_atomic(Path(root) / LATEST, path.name + "\n")


def is_temporary(path: str | os.PathLike) -> bool:
    """True when `path`'s completion marker says the checkpoint is temporary."""
    try:
        payload = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(payload, dict) and payload.get("temporary") is True


def remove_superseded_temporary(root: str | os.PathLike, newest: str | os.PathLike) -> list[Path]:
    """Delete the complete temporary checkpoints under `root` with a step below `newest`'s (the
    checkpoint just completed, never removed itself); return what was removed."""
    newest = Path(newest)
    newest_step = step_of(newest)
    if newest_step is None or not is_complete(newest):
        return []
    doomed = [
        path
        for path in list_checkpoints(root)
        if path != newest and (step_of(path) or 0) < newest_step and is_temporary(path)
    ]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed temporary checkpoint %s (superseded by %s)", path, newest.name)
    return doomed


def retain(
    root: str | os.PathLike, keep_last: int, *, protect: str | os.PathLike | None = None
) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all); return what was removed.

    `protect` (the checkpoint just saved, which `latest` names) is never removed, even when checkpoints
    with higher steps exist (left by an earlier run that went further before this one resumed from an
    older step). Partial directories are left alone here: one may be an asynchronous save in flight.
    """
    if keep_last <= 0:
        return []
    complete = list_checkpoints(root)
    kept = set(complete[-keep_last:])
    if protect is not None:
        kept.add(Path(protect))
    doomed = [path for path in complete if path not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed old checkpoint %s (keep_last=%d)", path, keep_last)
    return doomed


def clean_partial(root: str | os.PathLike) -> list[Path]:
    """Remove `step_<N>` directories without a completion marker and stale pointer temp files.

    Call only when no save into `root` is in flight (on restore, before training starts).
    """
    root = Path(root)
    removed = []
    for _, path in _step_dirs(root):
        if not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed partial checkpoint %s (left by an interrupted save)", path)
    if root.is_dir():
        for stale in root.glob(f".{LATEST}.tmp-*"):
            stale.unlink(missing_ok=True)
    return removed
