"""What the data was: a fingerprint of a run's input files and training set, which every checkpoint
records and a resume compares (a resume whose data changed is refused like a changed setting).

    file_fingerprint(path)                {"size", "digest", "full"}, or for a large file
                                          {"size", "digest", "samples", "mtime_ns"}
    data_fingerprint(config, train_set)   {"files": {name: file_fingerprint}, "dataset": {...}}
    fingerprint_changes(saved, now)       what differs, one phrase per file or fact ([] when nothing)
    fingerprint_summary(fingerprint)      a few words for logs: "2 files, 4,096 samples (digest 1a2b3c4d)"

Files are the ones the config's `data` section names (fields named like `path`, `val_path`, `shards`,
`*_dir`, `*_root`): a file is fingerprinted itself, a directory (a token-shard directory: its
`index.json` and every shard) file by file, its hidden files aside. The dataset facts are the training
set's length in samples, the tokens of token shards, and a mixture's weights and sources.

What a file's fingerprint holds:
- always its size and `digest`: BLAKE2b of the size and the first and last 64 KiB (`EDGE_BYTES`);
- `full`: BLAKE2b of the whole file, read in 1 MiB chunks, while hashing is cheap: files are hashed in
  full, in order, as long as the bytes hashed in full for one fingerprint stay within
  `FULL_HASH_BYTES` (1 GiB: about a second). A fine-tuning JSONL is hashed whole, so any edit is seen,
  a typo fixed in the middle of a line included;
- past that budget (a pretraining corpus: `bench/fingerprint.py` measures 1 TiB of shards), `samples`:
  BLAKE2b of `SAMPLES` blocks of 4 KiB spread evenly through the file, and `mtime_ns`, the file's
  modification time. An edit in place changes the time; a copy that does not keep times (`cp`
  without `-p`, `rsync` without `-t`) looks changed too: resume it with `checkpoint.allow_changes data`.

A resume compares the facts both fingerprints recorded: a checkpoint written before `full` and
`samples` existed (size and `digest` only) is compared by those, as it was then, without a warning
(logged at info); a file whose way of being fingerprinted changed (it grew past the budget) is
compared by its size and ends. What is recorded changing never refuses an old checkpoint by itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fntrain.config import flatten
from fntrain.data.mixing import Mixture

__all__ = ["EDGE_BYTES", "FULL_HASH_BYTES", "SAMPLES", "file_fingerprint", "data_files", "data_fingerprint",
           "fingerprint_changes", "fingerprint_summary"]  # fmt: skip

log = logging.getLogger("fntrain.data")

EDGE_BYTES = 64 << 10  # bytes hashed at each end of a file (a smaller file is hashed whole)
FULL_HASH_BYTES = 1 << 30  # files are hashed in full while one fingerprint has hashed at most this much
SAMPLES = 16  # blocks of SAMPLE_BYTES hashed, spread through a file too large to hash in full
SAMPLE_BYTES = 4 << 10
_CHUNK = 1 << 20
_PATH_FIELDS = ("path", "paths", "shards", "dir", "root", "files")
_CONTENT_KEYS = ("digest", "full", "samples")


def _digest() -> Any:
    return hashlib.blake2b(digest_size=16)


def _full_digest(file: Any) -> str:
    """BLAKE2b of the whole open `file`, streamed in 1 MiB chunks."""
    digest, buffer = _digest(), bytearray(_CHUNK)
    view = memoryview(buffer)
    file.seek(0)
    while count := file.readinto(buffer):
        digest.update(view[:count])
    return digest.hexdigest()


def _sampled_digest(file: Any, size: int) -> str:
    """BLAKE2b of the size and `SAMPLES` blocks at evenly spaced offsets (the same ones for a size)."""
    digest = _digest()
    digest.update(str(size).encode())
    for number in range(1, SAMPLES + 1):
        file.seek(max(size - SAMPLE_BYTES, 0) * number // (SAMPLES + 1))
        digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()


def file_fingerprint(path: str | os.PathLike, *, full: bool | None = None) -> dict[str, Any]:
    """{"size": bytes, "digest": 32 hex digits of the size and the first and last `EDGE_BYTES` (the
    whole file when it is at most twice that)}, and `full` (the whole file's BLAKE2b) when `full`, else
    `samples` and `mtime_ns` (see the module docstring). `full` None: hashed in full when the file is at
    most `FULL_HASH_BYTES`."""
    with open(path, "rb") as file:
        stat = os.fstat(file.fileno())
        size = stat.st_size
        digest = _digest()
        digest.update(str(size).encode())
        digest.update(file.read(EDGE_BYTES if size > 2 * EDGE_BYTES else size))
        if size > 2 * EDGE_BYTES:
            file.seek(size - EDGE_BYTES)
            digest.update(file.read(EDGE_BYTES))
        found: dict[str, Any] = {"size": size, "digest": digest.hexdigest()}
        if full if full is not None else size <= FULL_HASH_BYTES:
            found["full"] = _full_digest(file)
        else:
            found["samples"] = _sampled_digest(file, size)
            found["mtime_ns"] = stat.st_mtime_ns
    return found


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
    """The fingerprint a checkpoint records: every data file's `file_fingerprint` (hashed in full while
    the files so far total at most `FULL_HASH_BYTES`) and the training set's facts (JSON data)."""
    files: dict[str, Any] = {}
    budget = FULL_HASH_BYTES
    for name, path in data_files(config).items():
        files[name] = file_fingerprint(path, full=path.stat().st_size <= budget)
        budget -= files[name]["size"] if "full" in files[name] else 0
    return {"files": files, "dataset": _dataset_facts(train_set)}


def _utc(mtime_ns: Any) -> str:
    if not isinstance(mtime_ns, int):
        return repr(mtime_ns)
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(mtime_ns / 1e9))


def _file_change(name: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> str | None:
    """One phrase for a file that differs; only the facts both fingerprints recorded are compared."""
    if old is None:
        return f"{name}: new file"
    if new is None:
        return f"{name}: no longer there"
    if old.get("size") != new.get("size"):
        return f"{name}: size {old.get('size')} -> {new.get('size')} bytes"
    if any(key in old and key in new and old[key] != new[key] for key in _CONTENT_KEYS):
        return f"{name}: contents changed (same size, {new.get('size')} bytes)"
    if "mtime_ns" in old and "mtime_ns" in new and old["mtime_ns"] != new["mtime_ns"]:
        return (f"{name}: modified {_utc(new['mtime_ns'])} (was {_utc(old['mtime_ns'])}), same size; a file "
                "this large is compared by samples and its time")  # fmt: skip
    if "full" not in old and "samples" not in old:
        log.info("%s: the checkpoint's fingerprint holds its size and ends only (recorded before full hashes): "
                 "compared by those", name)  # fmt: skip
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
