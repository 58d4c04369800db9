"""Where an export writes: an output directory that must be free (or `overwrite`), written as a
temporary directory beside it and renamed into place only once complete, so a failed export leaves the
disk as it found it and an old output stays whole until the new one is complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fntrain.checkpoint.export import _umask
from fntrain.data.files import existing_ancestor

__all__ = ["check_out", "staged_out", "require_source_dir"]


def check_out(out: Path, overwrite: bool) -> Path:
    """Refuse an output that is a file, that cannot be created (a file where a parent should be), or a
    non-empty directory unless `overwrite`; returns the nearest existing ancestor."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {str(out)!r} is not empty (pass overwrite to replace it)")
    return existing_ancestor(out)


@contextlib.contextmanager
def staged_out(out: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh temporary directory beside `out` (in its nearest existing ancestor) to write into;
    renamed to `out` (replacing an old one only now, when `overwrite`; making missing parents only
    now) when the block succeeds, removed when it fails: a failed export leaves the disk as it was,
    and the old output stays whole until the new one is complete."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=check_out(out, overwrite)))
    try:
        yield staging
        if out.is_dir():
            check_out(out, overwrite)
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)
        os.chmod(out, 0o777 & ~_umask())  # mkdtemp makes 0700 directories
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def require_source_dir(source: str | os.PathLike, kind: str) -> None:
    """`source` is an existing directory, else a `FileNotFoundError` naming it as given and its `kind`."""
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{kind} {str(source)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"{kind} {str(source)!r} is a file, not a directory")
