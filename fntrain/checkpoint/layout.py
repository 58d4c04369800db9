"""Where checkpoints live on disk and when one counts as complete [S36]. Standard library only.

A checkpoint root holds one `step_<N>/` directory per save and a `latest` pointer file:

    <root>/step_<N>/.metadata        DCP's metadata, written last by DCP itself
    <root>/step_<N>/*.distcp         DCP's tensor data
    <root>/step_<N>/meta.json        TrainState, the non-tensor leaves of the app state, the config (rank 0)
    <root>/step_<N>/rank_<r>.json    per-rank RNG states and hook states
    <root>/step_<N>/manifest.json    every file's size and CRC-32 (`fntrain.checkpoint.verify`)
    <root>/step_<N>/COMPLETE         fntrain's completion marker, written only after `.metadata` exists
    <root>/latest                    the name of the newest complete checkpoint (write + os.replace)

A directory is complete only when both `.metadata` and `COMPLETE` exist; anything else is a partial
left by a crash: ignored when resolving "latest" and moved aside by `clean_partial`
(`step_25` -> `step_25.incomplete`, never deleted). A checkpoint that fails verification is moved
aside as `step_<N>.damaged`. Names with a suffix are no checkpoint to any function here: they are never
resolved, counted or deleted. A `COMPLETE` marker with `"temporary": true` marks a checkpoint to
delete once a later one is complete.

Deletion (`fntrain.checkpoint.retention`) only ever removes checkpoints that verify against
their manifest; a damaged one is moved aside with a warning, one without a manifest (saved by an older
fntrain) is left alone and not counted.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "checkpoint_root",
    "DCP_METADATA",
    "MARKER",
    "LATEST",
    "MANIFEST",
    "step_dir",
    "step_of",
    "is_complete",
    "list_checkpoints",
    "find_latest",
    "candidates",
    "move_aside",
    "write_json_atomic",
    "write_marker",
    "write_latest",
    "is_temporary",
    "clean_partial",
]

log = logging.getLogger("fntrain.checkpoint")

DCP_METADATA = ".metadata"
MARKER = "COMPLETE"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(config: Any, run_dir: str | os.PathLike) -> Path:
    """Where a run's checkpoints live: `config.dir` (a checkpoint config's; None or empty: unset) or
    `<run_dir>/checkpoints`."""
    return Path(config.dir).expanduser() if config.dir else Path(run_dir).expanduser() / "checkpoints"


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


def candidates(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints "latest" may resolve to, in the order to try them (the first that
    verifies wins): the pointer's checkpoint and those below it, newest first; without a valid pointer
    every complete checkpoint, newest first. Checkpoints above the pointer belong to a longer attempt
    this run has since resumed behind; they are not fallen back to."""
    root = Path(root)
    complete = list_checkpoints(root)
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named is not None and step_of(named) is not None and is_complete(root / named):
        top = step_of(named) or 0
        below = [path for path in complete if (step_of(path) or 0) < top]
        return [root / named, *reversed(below)]
    if named is not None:
        log.warning(
            "checkpoint pointer %s names %r, which is not a complete checkpoint; ignoring it", pointer, named
        )
    return list(reversed(complete))


def move_aside(path: str | os.PathLike, suffix: str) -> Path:
    """Rename `path` to `<path>.<suffix>` (or `<path>.<suffix>.<k>` when taken) and return the new name;
    what was there is kept whole."""
    path = Path(path)
    target = path.with_name(f"{path.name}.{suffix}")
    count = 0
    while target.exists():
        count += 1
        target = path.with_name(f"{path.name}.{suffix}.{count}")
    os.rename(path, target)
    _fsync_dir(path.parent)
    return target


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


def clean_partial(root: str | os.PathLike) -> list[Path]:
    """Move `step_<N>` directories without a completion marker aside (`step_<N>.incomplete`, never
    deleted; an empty one is removed) and remove stale pointer temp files; return the new names.

    Call only when no save into `root` is in flight (on restore, before training starts).
    """
    root = Path(root)
    moved = []
    for _, path in _step_dirs(root):
        if is_complete(path):
            continue
        if not any(path.iterdir()):
            path.rmdir()  # nothing in it to lose
            continue
        target = move_aside(path, "incomplete")
        moved.append(target)
        log.warning(
            "checkpoint %s has no completion marker (left by an interrupted save); moved aside to %s",
            path, target.name,
        )  # fmt: skip
    if root.is_dir():
        for stale in root.glob(f".{LATEST}.tmp-*"):
            stale.unlink(missing_ok=True)
    return moved
