"""Checkpoint integrity [S36]: a manifest of every file's size and checksum, written after the data and
before the completion marker, and checked before a checkpoint is trusted.

    <root>/step_<N>/manifest.json
    {"format": 1, "algorithm": "crc32",
     "files": {".metadata": {"crc32": "1c291ca3", "size": 4211}, "__0_0.distcp": {...}, "meta.json": {...}}}

Every regular file of the step directory is listed except the manifest, the `COMPLETE` marker (written
after it) and atomic-write temp files. CRC-32 (`zlib.crc32`, the fastest checksum in the standard library,
~2 GB/s a core, and it releases the GIL so files are summed in parallel) is there to catch accidental
damage: truncated or missing files, torn copies, flipped bits. It is not a defence against a crafted
checkpoint (whoever can change the data can rewrite the manifest; the restricted unpickler in
`safe_reader` is that defence), so a cryptographic hash would only cost time. The checksums are taken
from the written bytes, read back right after the write (from the page cache): `bench/checkpoint.py`
measures that against the save itself.

`damage(path)` names the first problem (file and reason) or returns None. A checkpoint saved before
manifests existed is *unverified but usable*: its DCP metadata must unpickle, its JSON files parse and
each data file hold at least the bytes DCP's metadata places in it; the contents are not checked.
`verify_collectively` shares the files between the ranks of a process group and agrees on one answer,
so ranks never pick different checkpoints. `verified(path)` is the cached check retention uses: a
checkpoint counts toward `keep_last` and may be deleted only when its manifest verifies.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.checkpoint import _dist
from fntrain.checkpoint.layout import DCP_METADATA, MANIFEST, MARKER, write_json_atomic
from fntrain.config import ConfigError

__all__ = [
    "MANIFEST",
    "MANIFEST_FORMAT",
    "ALGORITHM",
    "Damage",
    "CheckpointDamagedError",
    "checksum",
    "build_manifest",
    "write_manifest",
    "read_manifest",
    "has_manifest",
    "damage",
    "verify_collectively",
    "verified",
]

log = logging.getLogger("fntrain.checkpoint")

MANIFEST_FORMAT = 1
ALGORITHM = "crc32"
_CHUNK = 8 << 20  # bytes read at a time
_MAX_THREADS = 8


@dataclass(frozen=True)
class Damage:
    """What is wrong with a checkpoint: the file (a name inside the step directory) and why."""

    path: Path
    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path / self.file}: {self.reason}"


class CheckpointDamagedError(ConfigError):
    """A checkpoint that cannot be trusted (a damaged or incomplete one named explicitly); the message
    is one line naming the file and the reason (the command line prints it and exits 2)."""

    def __init__(self, damage: Damage, hint: str = ""):
        self.damage = damage
        super().__init__(f"damaged checkpoint: {damage}{hint}")


def checksum(file: str | os.PathLike) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of `file`, read in 8 MiB chunks."""
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(file, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            crc = zlib.crc32(view[:count], crc)
            size += count
    return size, f"{crc & 0xFFFFFFFF:08x}"


def _listed(path: Path) -> list[str]:
    """The files a manifest covers: every regular file but the manifest, the marker and temp files."""
    names = []
    for entry in path.iterdir():
        name = entry.name
        if name in (MANIFEST, MARKER) or ".tmp-" in name or not entry.is_file():
            continue
        names.append(name)
    return sorted(names)


def _map(function: Any, items: list[Any]) -> list[Any]:
    """`function` over `items`, in a few threads when there are several (zlib and file reads release
    the GIL); the pool is joined before this returns."""
    if len(items) <= 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(
        max_workers=min(len(items), _MAX_THREADS), thread_name_prefix="fntrain-crc"
    ) as pool:
        return list(pool.map(function, items))


def build_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the step directory `path` as it is on disk now (reads every file once)."""
    path = Path(path)
    names = _listed(path)
    sums = _map(lambda name: checksum(path / name), names)
    files = {name: {"size": size, ALGORITHM: crc} for name, (size, crc) in zip(names, sums, strict=True)}
    return {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "files": files}


def write_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Write `<path>/manifest.json` (atomically) from the written files; call after the data and DCP's
    metadata are written and before the completion marker. Returns the manifest."""
    path = Path(path)
    manifest = build_manifest(path)
    write_json_atomic(path / MANIFEST, manifest)
    _remember(path, manifest)
    return manifest


def has_manifest(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of `path`, None when it has none (saved before manifests); a ValueError when it
    is unreadable or not a manifest this fntrain knows."""
    file = Path(path) / MANIFEST
    try:
        text = file.read_text()
    except FileNotFoundError:
        return None
    manifest = json.loads(text)  # a JSONDecodeError is a ValueError
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("algorithm") != ALGORITHM
        or not all(
            isinstance(entry, dict) and "size" in entry and ALGORITHM in entry for entry in files.values()
        )
    ):
        raise ValueError(f"not a format-{MANIFEST_FORMAT} {ALGORITHM} manifest")
    return manifest


def _check_file(path: Path, name: str, expected: dict[str, Any], contents: bool) -> Damage | None:
    file = path / name
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        return Damage(path, name, "missing")
    except OSError as error:
        return Damage(path, name, f"unreadable ({error.strerror or error})")
    if size != expected["size"]:
        what = "truncated: " if size < expected["size"] else ""
        return Damage(path, name, f"{what}{size} bytes, the manifest says {expected['size']}")
    if contents:
        try:
            _, crc = checksum(file)
        except OSError as error:
            return Damage(path, name, f"unreadable ({error.strerror or error})")
        if crc != expected[ALGORITHM]:
            return Damage(path, name, f"changed: {ALGORITHM} {crc}, the manifest says {expected[ALGORITHM]}")
    return None


def _legacy_checks(path: Path) -> list[Any]:
    """The checks of a checkpoint without a manifest: what can be verified without checksums."""
    from fntrain.checkpoint.safe_reader import read_dcp_metadata

    def metadata_check() -> Damage | None:
        if not (path / DCP_METADATA).is_file():
            return Damage(path, DCP_METADATA, "missing")
        try:
            metadata = read_dcp_metadata(path)
        except Exception as error:  # noqa: BLE001 - any failure to read it is the damage
            return Damage(path, DCP_METADATA, f"unreadable ({type(error).__name__}: {error})")
        needed: dict[str, int] = {}
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = str(getattr(info, "relative_path", ""))
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            if name:
                needed[name] = max(needed.get(name, 0), end)
        for name, end in sorted(needed.items()):
            try:
                size = (path / name).stat().st_size
            except FileNotFoundError:
                return Damage(path, name, "missing")
            if size < end:
                return Damage(path, name, f"truncated: {size} bytes, DCP's metadata needs {end}")
        return None

    def json_check(name: str) -> Damage | None:
        try:
            json.loads((path / name).read_text())
        except FileNotFoundError:
            return Damage(path, name, "missing") if name == "meta.json" else None
        except (OSError, ValueError) as error:
            return Damage(path, name, f"unreadable ({error})")
        return None

    checks: list[Any] = [metadata_check, lambda: json_check("meta.json")]
    for rank_file in sorted(entry.name for entry in path.glob("rank_*.json")):
        checks.append(lambda name=rank_file: json_check(name))
    return checks


def _checks(path: Path, contents: bool) -> list[Any]:
    """The checks that together verify `path`, in the order their damage is reported; a check returns
    a Damage or None."""
    if not path.is_dir():
        return [lambda: Damage(path, "", "not a directory")]
    if not (path / MARKER).is_file():
        return [lambda: Damage(path, MARKER, "missing (an interrupted save?)")]
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as error:
        unreadable = Damage(path, MANIFEST, f"unreadable ({error})")
        return [lambda: unreadable]
    if manifest is None:
        return _legacy_checks(path)
    files = manifest["files"]
    checks = [lambda name=name: _check_file(path, name, files[name], contents) for name in sorted(files)]
    for required in (DCP_METADATA, "meta.json"):
        if required not in files:
            checks.append(lambda name=required: Damage(path, name, "not in the manifest"))
    return checks


def _first(found: Iterable[Damage | None]) -> Damage | None:
    return next((item for item in found if item is not None), None)


def damage(path: str | os.PathLike, *, contents: bool = True) -> Damage | None:
    """The first problem of the checkpoint at `path` (file and reason), or None when it verifies.

    `contents=False` checks presence and sizes only (no file is read)."""
    path = Path(path)
    checks = _checks(path, contents)
    found = _first(_map(lambda check: check(), checks))
    if found is None and contents and has_manifest(path):
        _remember(path, read_manifest(path))
    return found


def verify_collectively(path: str | os.PathLike, process_group: Any = None) -> Damage | None:
    """`damage(path)` computed by all ranks of `process_group` together (each checks a share of the
    files) and agreed: every rank gets the same answer. Every rank must call it (a collective)."""
    path = Path(path)
    if not _dist.initialized() or _dist.world_size(process_group) == 1:
        return damage(path)
    import torch.distributed as dist

    rank, world = _dist.rank(process_group), _dist.world_size(process_group)
    checks = _checks(path, contents=True)
    # this rank's checks are checks[rank], checks[rank + world], ...: each damage goes with the index of
    # the check that found it, so the ranks agree on the one `damage(path)` names (the first check's)
    found = _map(lambda check: check(), checks[rank::world])
    mine = next(((rank + world * i, d.file, d.reason) for i, d in enumerate(found) if d is not None), None)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=process_group)
    reported = sorted(item for item in gathered if item is not None)
    if reported:
        return Damage(path, *reported[0][1:])
    if has_manifest(path):
        _remember(path, read_manifest(path))
    return None


# ----------------------------------------------------------------------------- the retention cache

_cache_lock = threading.Lock()
_verified_at: dict[Path, tuple[Any, ...]] = {}  # checkpoint -> stat signature when it last verified


def _signature(path: Path, manifest: dict[str, Any]) -> tuple[Any, ...] | None:
    """Sizes, mtimes and inodes of the manifest and every file it lists; None when one is missing."""
    signature = []
    for name in (MANIFEST, *sorted(manifest["files"])):
        try:
            stat = (path / name).stat()
        except OSError:
            return None
        signature.append((name, stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return tuple(signature)


def _remember(path: Path, manifest: dict[str, Any] | None) -> None:
    if manifest is None:
        return
    signature = _signature(path, manifest)
    if signature is not None:
        with _cache_lock:
            _verified_at[path.resolve()] = signature


def verified(path: str | os.PathLike) -> bool | None:
    """True when the checkpoint at `path` verifies against its manifest, False when it is damaged, None
    when it has no manifest (saved before manifests: it cannot be verified). A checkpoint verified (or
    written) by this process is not read again while its files keep their sizes and mtimes."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError):
        return False
    if manifest is None:
        return None
    with _cache_lock:
        cached = _verified_at.get(path.resolve())
    if cached is not None and cached == _signature(path, manifest):
        return True
    return damage(path) is None
