"""What the data was: a cheap fingerprint of a run's input files and training set, which every
checkpoint records and a resume compares (a resume whose data changed is refused like a changed setting).

    file_fingerprint(path)                {"size", "digest"}: BLAKE2b of the size, the first and last 64 KiB
    data_fingerprint(config, train_set)   {"files": {name: file_fingerprint}, "dataset": {...}}
    fingerprint_changes(saved, now)       what differs, one phrase per file or fact ([] when nothing)
    fingerprint_summary(fingerprint)      a few words for logs: "2 files, 4,096 samples (digest 1a2b3c4d)"

Files are the ones the config's `data` section names (fields named like `path`, `val_path`, `shards`,
`*_dir`, `*_root`): a file is fingerprinted itself, a directory (a token-shard directory: its
`index.json` and every shard) file by file, its hidden files aside. The dataset facts are the training
set's length in samples, the tokens of token shards, and a mixture's weights and sources.

Why head and tail, not a full hash: a resume must stay instant on a 1 TB corpus (`bench/fingerprint.py`
measures 100 shards). Rows appended to a JSONL file change its size and tail; a re-tokenized shard
changes its index (hashed whole: it is small) and its head; a file rewritten in the middle with the same
size and ends is what this does not see, and the length facts catch most of those (a different number
of examples or tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fntrain.config import flatten
from fntrain.data.mixing import Mixture

__all__ = ["EDGE_BYTES", "file_fingerprint", "data_files", "data_fingerprint", "fingerprint_changes",
           "fingerprint_summary"]  # fmt: skip

EDGE_BYTES = 64 << 10  # bytes hashed at each end of a file (a smaller file is hashed whole)
_PATH_FIELDS = ("path", "paths", "shards", "dir", "root", "files")


def file_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """{"size": bytes, "digest": 32 hex digits}: BLAKE2b of the size and the first and last
    `EDGE_BYTES` (the whole file when it is at most twice that). Two reads, whatever the size."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        digest = hashlib.blake2b(str(size).encode(), digest_size=16)
        digest.update(file.read(EDGE_BYTES if size > 2 * EDGE_BYTES else size))
        if size > 2 * EDGE_BYTES:
            file.seek(size - EDGE_BYTES)
            digest.update(file.read(EDGE_BYTES))
    return {"size": size, "digest": digest.hexdigest()}


def _is_path_field(name: str) -> bool:
    return name in _PATH_FIELDS or name.endswith(tuple(f"_{suffix}" for suffix in _PATH_FIELDS))


def _named_paths(section: Any, prefix: str) -> Iterable[tuple[str, Path]]:
    for item in dataclasses.fields(section):
        if not _is_path_field(item.name):
            continue
        value = getattr(section, item.name)
        values = value if isinstance(value, (tuple, list)) else [value]
        for number, entry in enumerate(values):
            if isinstance(entry, str) and entry:
                name = f"{prefix}.{item.name}" + (f"[{number}]" if isinstance(value, (tuple, list)) else "")
                yield name, Path(entry).expanduser()


def data_files(config: Any) -> dict[str, Path]:
    """{display name: file} for every file the config's `data` section names: `data.path` for a file,
    `data.shards/shard_00000.bin` for each file of a directory (hidden ones aside), sorted."""
    section = getattr(config, "data", None)
    if section is None or not dataclasses.is_dataclass(section):
        return {}
    files: dict[str, Path] = {}
    for name, path in _named_paths(section, "data"):
        if path.is_file():
            files[name] = path
        elif path.is_dir():
            for member in sorted(path.rglob("*")):
                relative = member.relative_to(path)
                if member.is_file() and not any(part.startswith(".") for part in relative.parts):
                    files[f"{name}/{relative.as_posix()}"] = member
    return files


def _dataset_facts(dataset: Any) -> dict[str, Any]:
    """Length in samples, tokens of token shards, a mixture's weights and sources (recursively, through
    `Subset`s)."""
    facts: dict[str, Any] = {}
    try:
        facts["samples"] = len(dataset)
    except TypeError:  # a stream: no length
        pass
    if isinstance(dataset, Mixture):
        facts["weights"] = [round(weight, 12) for weight in dataset.weights]
        facts["sources"] = [_dataset_facts(source) for source in dataset.sources]
    elif isinstance(dataset, torch.utils.data.Subset):
        facts["of"] = _dataset_facts(dataset.dataset)
    index = getattr(getattr(dataset, "shards", None), "index", None)
    if index is not None and hasattr(index, "total_tokens"):
        facts["tokens"] = int(index.total_tokens)
    return facts


def data_fingerprint(config: Any, train_set: Any) -> dict[str, Any]:
    """The fingerprint a checkpoint records: every data file's `file_fingerprint` and the training
    set's facts (JSON data)."""
    files = {name: file_fingerprint(path) for name, path in data_files(config).items()}
    return {"files": files, "dataset": _dataset_facts(train_set)}




def _file_change(name: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str | None:
    if old is None:
        return f"{name}: new file"
    if new is None:
        return f"{name}: no longer there"
    if old.get("size") != new.get("size"):
        return f"{name}: size {old.get('size')} -> {new.get('size')} bytes"
    if old.get("digest") != new.get("digest"):
        return f"{name}: contents differ (same size, {new.get('size')} bytes)"
    return None


def fingerprint_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between the fingerprint `saved` with a checkpoint and the data `now`: one phrase
    per changed file (new, gone, size, contents) and per changed fact (samples, tokens, weights)."""
    old_files, new_files = saved.get("files", {}) or {}, now.get("files", {}) or {}
    changes = [
        change
        for name in sorted(set(old_files) | set(new_files))
        if (change := _file_change(name, old_files.get(name), new_files.get(name))) is not None
    ]
    old_facts = flatten(saved.get("dataset", {}) or {}, expand_lists=True)
    new_facts = flatten(now.get("dataset", {}) or {}, expand_lists=True)
    for name in sorted(set(old_facts) | set(new_facts)):
        if old_facts.get(name) != new_facts.get(name):
            changes.append(f"{name} {old_facts.get(name)!r} -> {new_facts.get(name)!r}")
    return changes


def fingerprint_summary(fingerprint: Mapping[str, Any] | None) -> str:
    """A few words for logs and run records: files, samples, and a short digest of the whole."""
    if not fingerprint:
        return "not recorded"
    files = fingerprint.get("files", {}) or {}
    samples = (fingerprint.get("dataset", {}) or {}).get("samples")
    digest = hashlib.blake2b(json.dumps(fingerprint, sort_keys=True).encode(), digest_size=4).hexdigest()
    parts = [f"{len(files)} file{'s' if len(files) != 1 else ''}"]
    if samples is not None:
        parts.append(f"{samples:,} samples")
    return ", ".join(parts) + f" (digest {digest})"
