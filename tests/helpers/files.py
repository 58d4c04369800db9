"""Input files the tests write the way a user's would be: JSONL rows, Parquet tables, and the hashes that
show a command left a directory as it was."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """`rows` as JSON lines at `path`; returns the path as a string (as a config field takes it)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def file_hashes(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones too), by its path relative to `root` -> its content's sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def file_hashes_and_siblings(root: Path) -> dict[str, str]:
    """`file_hashes(root)`, and under ".." the names beside `root` (a command must not make one there)."""
    return {**file_hashes(root), "..": ",".join(sorted(p.name for p in root.parent.iterdir()))}


def tree_hashes(root: Path) -> dict[str, str]:
    """Every path under `root`, in order: a file -> its content's sha256, a directory -> "<dir>"."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        for p in sorted(root.rglob("*"))
    }


def write_file(path: Path, data: str | bytes) -> str:
    """`data` at `path` (its folders made); returns the path as a string."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def relative_paths(root: Path) -> list[str]:
    """Every path under `root` (files and folders), relative to it, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))
