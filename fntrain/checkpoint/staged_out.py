"""Where an export writes, atomically: the output is written beside its target under a temporary name
(`.<name>.tmp-<pid>`) and renamed into place only once complete, so a failure (a full disk, an error)
leaves the previous output or nothing, never a half-written one.

    with replaced_dir(run_dir / "hf_model") as staging: ...     # a run's export: the old one replaced
    with staged_out(out, overwrite) as staging: ...             # `fntrain export`: a free (or overwrite) out
    with replaced_file(run_dir / "model.safetensors") as tmp: ...   # one file

A directory is replaced in three renames (`swap_in`): the old one aside (`.<name>.old-<pid>`), the new
one in, the old one removed; a failure between them puts the old one back. A failed export's error
carries what it was writing (`unwritten(error)`), so a run's failure line can say what is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fntrain.data.files import existing_ancestor

__all__ = ["check_out", "staged_out", "replaced_dir", "replaced_file", "swap_in", "unwritten", "Unwritten",
           "require_source_dir"]  # fmt: skip

log = logging.getLogger("fntrain.checkpoint")

# Files an export of model weights owns in its directory: an old one is never carried into a new export
# (stale shards beside new weights would load as one model).
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.index\.json$")


@dataclass(frozen=True)
class Unwritten:
    """What a failed export was writing: `path`, and whether a previous output there is kept."""

    path: Path
    previous_kept: bool


def unwritten(error: BaseException) -> Unwritten | None:
    """The output an atomic writer of this module was writing when `error` struck (None: the error
    struck elsewhere, e.g. while gathering the weights)."""
    found = getattr(error, "fntrain_unwritten", None)
    return found if isinstance(found, Unwritten) else None


def _mark(error: BaseException, out: Path, previous_kept: bool) -> None:
    if unwritten(error) is None:  # the innermost writer knows best
        try:
            error.fntrain_unwritten = Unwritten(out, previous_kept)  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without a __dict__: the line says less
            pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def swap_in(staging: Path, out: Path, *, keep_other_files: bool = False) -> None:
    """Rename the complete `staging` to `out`. An old `out` is renamed aside first and removed only once
    the new one is in place (a failed rename in puts it back). `keep_other_files`: the old directory's
    entries that the new one lacks and that are not weight files (a README the user put there) are
    moved into the new one, as `save_pretrained` leaves them; one that cannot be moved stays in the
    aside directory, which is then kept (a warning names it)."""
    aside = None
    if out.exists() or out.is_symlink():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        if aside.exists():
            _remove(aside)  # a leftover of this process's earlier attempt
        os.replace(out, aside)
    try:
        os.replace(staging, out)
    except BaseException:
        if aside is not None:
            os.replace(aside, out)
        raise
    if aside is None:
        return
    left = []
    if keep_other_files and aside.is_dir():
        for entry in aside.iterdir():
            if (out / entry.name).exists() or WEIGHT_FILES.match(entry.name):
                continue
            try:
                os.replace(entry, out / entry.name)
            except OSError:
                left.append(entry.name)
    if left:
        log.warning("the previous %s is kept at %s: %s could not be moved into the new one", out.name, aside,
                    ", ".join(sorted(left)))  # fmt: skip
        return
    try:
        _remove(aside)
    except OSError as error:  # the new output is complete; only the old one's space is not freed
        log.warning("the previous %s could not be removed (%s); it is at %s", out.name, error, aside)


@contextlib.contextmanager
def replaced_dir(out: str | os.PathLike, *, keep_other_files: bool = True) -> Iterator[Path]:
    """A new empty directory `.<name>.tmp-<pid>` beside `out` to write into; when the block succeeds it
    replaces `out` (`swap_in`, other files of the old one kept by default), when it fails it is removed
    and `out` is as it was (the error carries `unwritten`). Missing parents of `out` are made. Where
    `out`'s parent takes no new entry but `out` does (a writable output_dir in a read-only directory),
    it is written inside `out` and moved in file by file (`_move_contents`)."""
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.exists()
    staging, inside = _make_staging(out)
    try:
        yield staging
        if inside:
            _move_contents(staging, out)
        else:
            swap_in(staging, out, keep_other_files=keep_other_files)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        _mark(error, out, previous)
        raise


def _make_staging(out: Path) -> tuple[Path, bool]:
    """(a new empty staging directory, whether it is inside `out`): beside `out`, else inside it."""
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if staging.exists():
        _remove(staging)  # a leftover of this process's earlier attempt
    try:
        staging.mkdir()
        return staging, False
    except PermissionError:  # EACCES, EPERM: the parent is not ours to write; EROFS is an OSError: raised
        if not out.is_dir():
            raise
    staging = out / f".{out.name}.tmp-{os.getpid()}"
    if staging.exists():
        _remove(staging)
    staging.mkdir()
    return staging, True


def _move_contents(staging: Path, out: Path) -> None:
    """The complete `staging` (inside `out`) moved into `out` entry by entry, over the old ones, the old
    export's weight files the new one lacks removed first: renames, which a full disk does not fail,
    but not one atomic step (the fallback of `replaced_dir`)."""
    for entry in out.iterdir():
        if entry != staging and WEIGHT_FILES.match(entry.name) and not (staging / entry.name).exists():
            _remove(entry)
    for entry in staging.iterdir():
        target = out / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()


@contextlib.contextmanager
def replaced_file(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary path `.<name>.tmp-<pid>` beside the file `out` to write; renamed over `out` (mode
    0666 less the umask) when the block succeeds, removed when it fails (`out` as it was; the error
    carries `unwritten`). Missing parents of `out` are made."""
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.exists()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _mark(error, out, previous)
        raise


def check_out(out: Path, overwrite: bool) -> Path:
    """Refuse an output that is a file, that cannot be created (a file where a parent should be), or a
    non-empty directory unless `overwrite`; returns the nearest existing ancestor."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {str(out)!r} is not empty (pass --overwrite to replace it)")
    return existing_ancestor(out)


@contextlib.contextmanager
def staged_out(out: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh temporary directory beside `out` (in its nearest existing ancestor) to write into;
    renamed to `out` (replacing an old one only now, when `overwrite`, by `swap_in`; making missing
    parents only now) when the block succeeds, removed when it fails: a failed export leaves the disk
    as it was, and the old output stays whole until the new one is complete."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=check_out(out, overwrite)))
    previous = out.exists()
    try:
        yield staging
        if out.is_dir():
            check_out(out, overwrite)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700 directories
        out.parent.mkdir(parents=True, exist_ok=True)  # missing parents are made only now
        swap_in(staging, out)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        _mark(error, out, previous)
        raise


def require_source_dir(source: str | os.PathLike, kind: str) -> None:
    """`source` is an existing directory, else a `FileNotFoundError` naming it as given and its `kind`."""
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{kind} {str(source)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"{kind} {str(source)!r} is a file, not a directory")


def _umask() -> int:
    """The process umask, read without changing it (Linux), else the common 022."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
