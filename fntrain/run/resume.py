"""How a resume is decided: once, in phase 1, from the files alone; verified in phase 2.

    starting_over(config)          --overwrite on a job's first launch resumes nothing of the old run
    decide_resume(config)          phase 1: the checkpoint checkpoint.restore_from names (or nothing),
                                   its file sizes checked, its settings compared with this run's
    with_data(config, resume, fp)  phase 1, once the data was read: its fingerprint compared with the
                                   one the checkpoint recorded (changed data is refused like a setting)
    verified_resume(resume, ...)   phase 2: the same choice verified in full by every rank together
                                   (a newest checkpoint damaged inside passes to an older one)

`restore_from` is parsed here and nowhere else: "none", "latest" / "auto" (the newest complete
checkpoint under the checkpoint root, if any), or a path. A weights-only restore starts a new run, so
any setting may change; otherwise a setting that changes the numbers needs checkpoint.allow_changes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fntrain.checkpoint import find_latest, read_meta
from fntrain.checkpoint.layout import MARKER
from fntrain.checkpoint.restorer import NAMED_DAMAGED_HINT, resolve_source, restore
from fntrain.checkpoint.verify import CheckpointDamagedError, damage
from fntrain.config import ConfigError
from fntrain.data.fingerprint import fingerprint_changes, fingerprint_summary
from fntrain.hooks.checkpoint import checkpoint_root
from fntrain.run.config import JobConfig
from fntrain.run.config_file import config_to_dict
from fntrain.run.directory import config_changes
from fntrain.state import TrainState

__all__ = [
    "Resume", "first_launch", "starting_over", "decide_resume", "with_data", "data_changes", "verified_resume",
    "resume_changes", "restore_state",
]  # fmt: skip

log = logging.getLogger("fntrain.run.resume")


@dataclass(frozen=True)
class Resume:
    """The resume decision: `source` is what restore_from asks for (None: a fresh start), `path` the
    checkpoint it names now (None: nothing to resume yet), `changes` the allowed setting changes
    ({field: [old, new]}) against that checkpoint."""

    source: str | None = None
    path: Path | None = None
    changes: dict[str, list[Any]] = field(default_factory=dict)


def first_launch() -> bool:
    """Whether this is the job's first launch (not a torchrun restart of it)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


def starting_over(config: JobConfig) -> JobConfig:
    """`config` as this launch runs it: starting over (`overwrite`, on a job's first launch) resumes
    nothing from the run directory's own checkpoints (latest / auto), which move aside with the old
    run; an explicit checkpoint path is still restored. A torchrun restart keeps the run it began."""
    if config.overwrite and first_launch() and config.checkpoint.restore_from in ("latest", "auto"):
        return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, restore_from="none"))
    return config


def decide_resume(config: JobConfig) -> Resume:
    """Phase 1: the checkpoint `checkpoint.restore_from` names, from the files alone (a missing or
    cut-short file shows in the sizes; no file is read, no process group needed), and the setting
    changes resuming it brings. A `ConfigError` for a path that does not exist or settings that differ."""
    source = config.checkpoint.restore_from
    if source == "none":
        return Resume()
    if source in ("latest", "auto"):
        path = find_latest(checkpoint_root(config.checkpoint, config.run_dir))
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"checkpoint.restore_from {source!r} does not exist")
        if (path / MARKER).is_file():
            problem = damage(path, contents=False)
            if problem is not None:
                raise CheckpointDamagedError(problem, NAMED_DAMAGED_HINT)
    return Resume(source, path, resume_changes(config, path))


def resume_changes(config: JobConfig, path: Path | None) -> dict[str, list[Any]]:
    """The setting changes a resume from the checkpoint `path` brings, allowed by
    `checkpoint.allow_changes`; any other change of a field that changes the numbers is a `ConfigError`
    listing them. A weights-only restore starts a new run: any change goes."""
    checkpoint = config.checkpoint
    if path is None or checkpoint.weights_only:
        return {}
    try:
        saved = read_meta(path).get("config")
    except (OSError, ValueError):  # unreadable: the verification in phase 2 says what is wrong with it
        return {}
    if not saved:
        return {}
    allowed = {name.replace("-", "_") for name in checkpoint.allow_changes}
    allowed.discard("data")  # the data itself, compared by its fingerprint (data_changes)
    changes = config_changes(saved, config_to_dict(config), free=config.FREE_FIELDS)
    refused = [(name, old, new) for name, old, new in changes if name not in allowed]
    if refused:
        listed = "; ".join(f"`{name}` {old!r} -> {new!r}" for name, old, new in refused)
        raise ConfigError(
            f"checkpoint.restore_from {str(path)!r} belongs to a run with other settings: {listed}; "
            "resume with the same settings, or name each field in checkpoint.allow_changes"
        )
    return {name: [old, new] for name, old, new in changes}


def data_changes(
    config: JobConfig, path: Path | None, fingerprint: dict[str, Any] | None
) -> dict[str, list[Any]]:
    """{"data": [as saved, now]} when the data `fingerprint` differs from the one the checkpoint `path`
    recorded and `data` is in checkpoint.allow_changes; a `ConfigError` naming each changed file and
    fact when it is not. Nothing to compare (no checkpoint, one saved before fingerprints, a
    weights-only restore): {}."""
    if path is None or fingerprint is None or config.checkpoint.weights_only:
        return {}
    try:
        saved = read_meta(path).get("data")
    except (OSError, ValueError):  # unreadable: the verification in phase 2 says what is wrong with it
        return {}
    changes = fingerprint_changes(saved, fingerprint) if saved else []
    if not changes:
        return {}
    listed = "; ".join(changes)
    if "data" not in config.checkpoint.allow_changes:
        raise ConfigError(
            f"checkpoint.restore_from {str(path)!r} was saved with other data: {listed}; resume with the "
            "same data, or add data to checkpoint.allow_changes"
        )
    log.warning("resuming with changed data (checkpoint.allow_changes data): %s", listed)
    return {"data": [fingerprint_summary(saved), fingerprint_summary(fingerprint)]}


def with_data(config: JobConfig, resume: Resume, fingerprint: dict[str, Any] | None) -> Resume:
    """`resume` with the data change it brings (see `data_changes`)."""
    changes = data_changes(config, resume.path, fingerprint)
    return dataclasses.replace(resume, changes={**resume.changes, **changes}) if changes else resume


def verified_resume(config: JobConfig, resume: Resume, fingerprint: dict[str, Any] | None = None) -> Resume:
    """Phase 2 (every rank; a collective under a process group): `resume` with its checkpoint verified
    in full. Under latest / auto a checkpoint damaged inside is passed over for the newest good one,
    whose settings and data (`fingerprint`) are then compared too; a named checkpoint that is damaged is
    an error."""
    if resume.source is None:
        return resume
    path = resolve_source(resume.source, checkpoint_root(config.checkpoint, config.run_dir))
    if path == resume.path:
        changes = resume.changes
    else:
        changes = {**resume_changes(config, path), **data_changes(config, path, fingerprint)}
    for name, (old, new) in changes.items():
        log.warning("resuming with %s changed from %r to %r (checkpoint.allow_changes)", name, old, new)
    return Resume(resume.source, path, changes)


def restore_state(config: JobConfig, built: Any, hooks: list[Any], resume: Resume) -> TrainState:
    """Restore the verified checkpoint of `resume` into the built components and the hooks' states
    [S36]; the TrainState to train from (a fresh one without a checkpoint). Every rank calls it."""
    if resume.path is None:
        return TrainState()
    runtime = built.runtime
    return restore(resume.path, built.components, hooks=hooks, weights_only=config.checkpoint.weights_only,
                   device=runtime.device, model_part=runtime.pp_size > 1, verified=True)  # fmt: skip
