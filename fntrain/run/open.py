"""Phase 2 begins: the run directory opened as a transaction that commits at the first finished step.

    opened = open_run(config, runtime, launch)   survey the run directory, move an old run aside (the
                                         launch says so), open this rank's log, write run_metadata.json
    opened.progress                      the hook that commits at the first STEP_END and remembers the
                                         step a failure struck
    opened.undo()                        before the first step: the directory as it was found (a new one
                                         removed, an old run moved back, rewritten files restored,
                                         appended logs cut back)
    opened.close()                       close this rank's log

Why hand-written: no library keeps a directory transactional; this keeps only what a failed start can
have changed (files and directories it created, the few small files it rewrites, the logs it appended to),
never the checkpoints, which nothing writes before the first step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fntrain.checkpoint.layout import checkpoint_root
from fntrain.checkpoint.space import CheckpointSaveError
from fntrain.loop import Event
from fntrain.run.config import JobConfig
from fntrain.run.directory import move_aside
from fntrain.run.launch import Launch
from fntrain.run.logs import rank_log_path, rank_logs
from fntrain.run.metadata import read_attempt, write_run_metadata

__all__ = ["Found", "survey", "restore_found", "Progress", "OpenedRun", "open_run"]

log = logging.getLogger("fntrain.run.open")

_KEPT_BYTES = 16 << 20  # top-level files up to this size are kept whole: the ones a start rewrites are small


@dataclass(frozen=True)
class Found:
    """What the run directory held before this launch touched it: `created` is the topmost directory
    that did not exist (None: the run directory existed), `sizes` every file's size (relative paths,
    the checkpoint root left out), `contents` the bytes of its small top-level files."""

    run_dir: Path
    created: Path | None
    sizes: dict[str, int] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)


def survey(run_dir: Path, skip: Path) -> Found:
    """What `run_dir` holds now, leaving out the directory `skip` (the checkpoint root)."""
    if not run_dir.exists():
        created = run_dir
        while not created.parent.exists():
            created = created.parent
        return Found(run_dir, created)
    sizes, contents = {}, {}
    for dirpath, dirnames, filenames in os.walk(run_dir):
        dirnames[:] = [name for name in dirnames if Path(dirpath, name) != skip]
        for name in filenames:
            path = Path(dirpath, name)
            relative = str(path.relative_to(run_dir))
            sizes[relative] = path.stat().st_size
            if path.parent == run_dir and sizes[relative] <= _KEPT_BYTES:
                contents[relative] = path.read_bytes()
    return Found(run_dir, None, sizes, contents)


def restore_found(found: Found, skip: Path) -> None:
    """Put the run directory back as `found` saw it (see the module docstring)."""
    if found.created is not None:
        shutil.rmtree(found.created, ignore_errors=True)
        return
    for dirpath, _, filenames in os.walk(found.run_dir, topdown=False):
        if Path(dirpath) == skip or skip in Path(dirpath).parents:
            continue
        for name in filenames:
            path = Path(dirpath, name)
            relative = str(path.relative_to(found.run_dir))
            if relative in found.contents:
                if path.read_bytes() != found.contents[relative]:
                    path.write_bytes(found.contents[relative])
            elif relative not in found.sizes:
                path.unlink()
            elif path.stat().st_size > found.sizes[relative]:  # an appended log: cut back
                os.truncate(path, found.sizes[relative])
        if Path(dirpath) != found.run_dir and not any(Path(dirpath).iterdir()):
            Path(dirpath).rmdir()  # a directory this launch made, now empty
    for relative, data in found.contents.items():  # a kept file this launch replaced or removed
        path = found.run_dir / relative
        if not path.exists():
            path.write_bytes(data)


class Progress:
    """The last hook of a run: commits the transaction at the first finished step and remembers how far
    the run got (`step`: the last finished step; `failed_at`: the step a failure struck). A launch of
    a complete run starts committed: it trains nothing, and its exports are written again."""

    def __init__(self, committed: bool = False) -> None:
        self.committed = committed
        self.step: int | None = None
        self.failed_at: int | None = None

    def __call__(self, event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_END:
            self.committed, self.step = True, state.global_step
        elif event is Event.ABORT:  # a failed save names its own step (it fails after that step ended)
            self.failed_at = info.step if isinstance(info, CheckpointSaveError) else state.global_step + 1


@dataclass
class OpenedRun:
    """An open run directory: what it held, where an old run went, this rank's log, which launch this
    is, and the progress hook that commits it."""

    found: Found | None  # rank 0 alone keeps and restores the survey
    checkpoints: Path
    aside: Path | None
    log_path: Path
    attempt: int
    progress: Progress
    logs: contextlib.ExitStack

    def undo(self) -> None:
        """Before the first step: leave the run directory as it was found (rank 0)."""
        if self.found is None:
            return
        restore_found(self.found, self.checkpoints)
        if self.aside is not None:
            os.replace(self.aside, self.found.run_dir)  # the old run, back where it was

    def close(self) -> None:
        self.logs.close()


def open_run(config: JobConfig, runtime: Any, launch: Launch) -> OpenedRun:
    """Survey the run directory (rank 0), move an old run aside when `launch` says so (the other ranks
    wait), open this rank's log and write run_metadata.json (every rank: a gather)."""
    run_dir = Path(config.run_dir).expanduser()
    root = checkpoint_root(config.checkpoint, config.run_dir)
    found, aside = None, None
    if runtime.is_main:
        found = survey(run_dir, root)
        if launch.moves_aside:
            aside = move_aside(run_dir)
            log.warning("overwrite: the run in %s moved to %s", config.run_dir, aside)
            found = Found(run_dir, run_dir)
    if runtime.distributed:
        dist.barrier()  # no rank writes into the directory before the old run is out of the way
    logs = contextlib.ExitStack()
    logs.enter_context(rank_logs(run_dir, runtime.rank, restart_count=launch.restart_count))
    write_run_metadata(run_dir, runtime)
    attempt = read_attempt(run_dir) if runtime.is_main else 0
    progress = Progress(committed=launch.complete)
    return OpenedRun(found, root, aside, rank_log_path(run_dir, runtime.rank), attempt, progress, logs)
