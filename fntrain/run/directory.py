"""One run per directory, and a resume only into the same run.

    holds_run(run_dir, checkpoint_root)        what in a directory says a run lives there
    aside_name(run_dir)                        where --overwrite moves an old run
    move_aside(run_dir)                        --overwrite: the old run moves to <run_dir>.replaced-<time>
    config_changes(saved, current, free=...)   what a resume would change, field by field

Nothing here deletes anything: starting over moves the old run aside, whole. Standard library only.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fntrain.config import flatten

__all__ = ["RUN_FILES", "holds_run", "aside_name", "move_aside", "config_changes", "flatten"]

RUN_FILES = ("config.json", "metrics.jsonl", "model.safetensors")  # written by every run that trained


def _has_checkpoints(root: Path) -> bool:
    return root.is_dir() and any(entry.name.startswith("step_") for entry in root.iterdir())


def holds_run(run_dir: str | os.PathLike, checkpoint_root: str | os.PathLike) -> list[str]:
    """The names of what in `run_dir` belongs to a run (its config, metrics, weights, checkpoints);
    empty when the directory is missing or holds none of them (logs of a failed start do not count)."""
    run_dir, root = Path(run_dir).expanduser(), Path(checkpoint_root).expanduser()
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if _has_checkpoints(root):
        found.append(f"{root.name}/" if root.parent == run_dir else str(root))
    return found


def aside_name(run_dir: str | os.PathLike, now: datetime.datetime | None = None) -> Path:
    """Where `move_aside` puts the run in `run_dir`: <run_dir>.replaced-<YYYYmmdd-HHMMSS>."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    run_dir = Path(run_dir).expanduser()
    return run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")


def move_aside(run_dir: str | os.PathLike) -> Path:
    """Rename `run_dir` (the whole old run) to `aside_name(run_dir)`, numbered if that exists; return it."""
    target = aside_name(run_dir)
    candidate, number = target, 1
    while candidate.exists():
        candidate, number = target.with_name(f"{target.name}.{number}"), number + 1
    os.replace(Path(run_dir).expanduser(), candidate)
    return candidate


def _covered(field: str, names: Iterable[str]) -> bool:
    return any(field == name or field.startswith(f"{name}.") for name in names)


def config_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, free: Iterable[str] = ()
) -> list[tuple[str, Any, Any]]:
    """(field, saved value, current value) for every field that differs between two resolved configs,
    except those under a `free` name (a field or a whole section). A field only one side has counts
    as changed from/to None."""
    old, new, free = flatten(saved), flatten(current), tuple(free)
    changed = []
    for field in sorted(set(old) | set(new)):
        if _covered(field, free):
            continue
        before, after = old.get(field), new.get(field)
        if isinstance(before, list) or isinstance(after, list):  # tuples written as JSON lists
            before, after = list(before or []), list(after or [])
        if before != after:
            changed.append((field, old.get(field), new.get(field)))
    return changed
