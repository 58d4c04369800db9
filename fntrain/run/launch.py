"""What this launch of a run is, decided once and passed on as one record.

    decide_launch(config, restart_count, ...)   phase 1, from the files alone: a `Launch`
    verify_launch(config, launch, ...)          phase 2, every rank together: the checkpoint verified in
                                                full; a damaged one named by path is refused, under
                                                latest / auto the newest good one is decided again here
    restore_launch(config, launch, built, hooks)   the TrainState the launch trains from

A launch is one of: fresh (nothing to restore; under latest / auto, a run directory whose run has no
complete checkpoint yet starts that run again in place, its settings compared with its config.json as a
resume's are with the checkpoint's), resume (a checkpoint, with the setting changes it
brings), overwrite (--overwrite on a job's first launch: the old run moves aside whole) or complete (the
checkpoint is at the run's last step: nothing to train, the exports are written again). A torchrun
restart of a job (restart_count > 0) keeps the run its first launch began.

`checkpoint.restore_from` is parsed here and nowhere else: "none", "latest" / "auto" (the newest
complete checkpoint under the checkpoint root, if any), or a path. A weights-only restore starts a new
run, so any setting may change; otherwise a setting that changes the numbers needs
checkpoint.allow_changes, and changed data needs `data` in it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fntrain.checkpoint import find_latest, read_meta
from fntrain.checkpoint.layout import MARKER, checkpoint_root
from fntrain.checkpoint.restorer import NAMED_DAMAGED_HINT, resolve_source, restore
from fntrain.checkpoint.verify import CheckpointDamagedError, damage
from fntrain.config import ConfigError, flatten
from fntrain.data.fingerprint import fingerprint_changes, fingerprint_summary
from fntrain.run.config import JobConfig
from fntrain.run.directory import aside_name, config_changes, holds_run
from fntrain.run.recipe_of import label_of, other_recipe
from fntrain.run.resolved import config_to_dict, path_fields, recorded_config, same_file
from fntrain.state import TrainState

__all__ = ["Launch", "requested_source", "decide_launch", "verify_launch", "restore_launch"]

log = logging.getLogger("fntrain.run.launch")

_RESUME_WAYS_OUT = "resume with the same settings, or name each field in checkpoint.allow_changes"


@dataclass(frozen=True)
class Launch:
    """What this launch is: `source` is what checkpoint.restore_from asks for (None: nothing, or the
    run starts over), `path` the checkpoint it continues (None: it starts at step 0), `changes` the
    allowed setting changes ({field: [old, new]}) against it, `moves_aside` whether the old run in the
    run directory moves aside first, `complete` whether the checkpoint already reached the run's end,
    `said` the warning that tells the user of each allowed change (verify_launch logs them)."""

    restart_count: int = 0
    source: str | None = None
    path: Path | None = None
    changes: dict[str, list[Any]] = field(default_factory=dict)
    moves_aside: bool = False
    complete: bool = False
    said: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """fresh, resume, overwrite or complete (an overwrite that restores a named checkpoint is a resume)."""
        if self.complete:
            return "complete"
        if self.path is not None:
            return "resume"
        return "overwrite" if self.moves_aside else "fresh"

    @property
    def resumes(self) -> bool:
        """Whether the run asked to continue from a checkpoint (one may not exist yet under auto)."""
        return self.source is not None


def decide_launch(config: JobConfig, restart_count: int, *, fingerprint: dict[str, Any] | None = None,
                  train_iters: int | None = None) -> Launch:  # fmt: skip
    """Phase 1: the launch `config` asks for in its run directory, from the files alone (a missing or
    cut-short checkpoint file shows in the sizes; nothing is written, no process group needed). A
    `ConfigError` for a second run into a directory that holds one, a checkpoint path that does not
    exist, or settings or data (`fingerprint`) that differ from the checkpoint's; under latest / auto
    with no complete checkpoint yet, settings that differ from the run directory's config.json."""
    checkpoint = config.checkpoint
    root = checkpoint_root(checkpoint, config.run_dir)
    _refuse_shared_root(config, root)
    found = holds_run(config.run_dir, root)
    source = requested_source(config, restart_count)
    if found and source is None and not config.overwrite:
        _refuse_second_run(config, found, find_latest(root))
    moves_aside = _starts_over(config, restart_count) and bool(found)
    if source is None:
        return Launch(restart_count, moves_aside=moves_aside)
    path = find_latest(root) if source in ("latest", "auto") else _named_checkpoint(source)
    if path is None and found and not moves_aside:
        return _again_in_place(config, restart_count, source)
    return _launch_from(config, restart_count, source, path, fingerprint, train_iters, moves_aside=moves_aside)


def _again_in_place(config: JobConfig, restart_count: int, source: str) -> Launch:
    """latest / auto with no complete checkpoint yet (a run killed before its first save): the run
    starts again in place (its metrics log is rewound, its files rewritten), so it must be the same
    run: its settings are compared with the run directory's config.json as a resume's are with the
    checkpoint's (a weights-only restore starts a new run: anything goes)."""
    saved = None if config.checkpoint.weights_only else _run_config(config.run_dir)
    aside = str(aside_name(config.run_dir))
    changes = _setting_changes(
        config, saved, f"run_dir {config.run_dir!r} holds a run (no complete checkpoint yet) with other settings",
        f"rerun with the same settings, name each field in checkpoint.allow_changes, or start a new run: "
        f"`overwrite` (which moves the old run to {aside!r}) or another `run_dir`",
    )  # fmt: skip
    return Launch(restart_count, source, changes=changes, said=_setting_lines("starting the run again", changes))


def _refuse_shared_root(config: JobConfig, root: Path) -> None:
    """One run per checkpoint directory: a checkpoint.dir outside run_dir whose newest checkpoint records
    another run directory that still exists (two run directories would write into one) is a
    `ConfigError` naming both and the ways out. A root inside run_dir is the run directory's own (a
    moved or copied run keeps its checkpoints), and so is one whose recorded run directory is gone."""
    latest = find_latest(root)
    if latest is None:
        return
    run_dir = Path(config.run_dir).expanduser().resolve()
    if root.resolve().is_relative_to(run_dir):
        return
    owner = _meta(latest).get("run_dir")
    if not isinstance(owner, str) or not Path(owner).is_dir() or Path(owner).resolve() == run_dir:
        return
    raise ConfigError(
        f"checkpoint.dir {str(config.checkpoint.dir)!r} holds the checkpoints of the run in {owner!r}, not of "
        f"run_dir {config.run_dir!r}: two run directories cannot share one checkpoint directory; resume that "
        f"run with `run_dir` {owner!r}, or start a new run from its checkpoint without writing there: "
        f"checkpoint.restore_from {str(latest)!r} and no checkpoint.dir (its own: <run_dir>/checkpoints)"
    )


def _run_config(run_dir: str) -> dict[str, Any] | None:
    """The resolved config the run in `run_dir` wrote (config.json), or None when there is none or it
    cannot be read (nothing to compare, as for a checkpoint without a readable meta.json)."""
    try:
        saved = json.loads((Path(run_dir).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def _refuse_second_run(config: JobConfig, found: list[str], latest: Path | None) -> None:
    """A `ConfigError` for a new run into a run directory that holds one, naming only the ways out that
    work: resuming (when it has a complete checkpoint) and starting over."""
    held = f"run_dir {config.run_dir!r} already holds a run ({', '.join(map(repr, found))})"
    over = f"start over with `overwrite`, which moves the old run to {str(aside_name(config.run_dir))!r}"
    if latest is not None:
        raise ConfigError(f"{held}: resume it with checkpoint.restore_from auto (its newest checkpoint is "
                          f"{latest.name}), or {over}")  # fmt: skip
    raise ConfigError(f"{held} with no complete checkpoint to resume: {over}")


def _starts_over(config: JobConfig, restart_count: int) -> bool:
    """--overwrite on a job's first launch (a torchrun restart keeps the run its first launch began)."""
    return config.overwrite and restart_count == 0


def requested_source(config: JobConfig, restart_count: int = 0) -> str | None:
    """What checkpoint.restore_from asks this launch to continue: "latest", "auto" or a path; None for
    none, and for latest / auto when the run starts over (the old run's checkpoints move aside with it).
    A plan (no launch yet) asks it for a job's first launch."""
    source = config.checkpoint.restore_from
    if source == "none" or (_starts_over(config, restart_count) and source in ("latest", "auto")):
        return None
    return source


def _named_checkpoint(source: str) -> Path:
    """The checkpoint directory a path in restore_from names: it exists, and a complete one's files
    have their recorded sizes."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"checkpoint.restore_from {source!r} does not exist")
    if (path / MARKER).is_file():
        problem = damage(path, contents=False)
        if problem is not None:
            raise CheckpointDamagedError(problem, NAMED_DAMAGED_HINT)
    return path


def _launch_from(config: JobConfig, restart_count: int, source: str, path: Path | None,
                 fingerprint: dict[str, Any] | None, train_iters: int | None, *, moves_aside: bool) -> Launch:  # fmt: skip
    """The launch that continues the checkpoint `path` (None: none exists yet): its setting and data
    changes, and whether it is already complete. The one decision both phases use."""
    if path is None:
        return Launch(restart_count, source, moves_aside=moves_aside)
    meta = _meta(path) if not config.checkpoint.weights_only else {}
    _refuse_other_recipe(config, source, path, meta.get("recipe"))
    settings = _setting_changes(config, meta.get("config"), f"checkpoint.restore_from {str(path)!r} belongs to a "
                                "run with other settings", _resume_ways_out(config, source))  # fmt: skip
    data, data_said = _data_changes(config, path, meta.get("data"), fingerprint)
    step = int((meta.get("train_state") or {}).get("global_step", 0))
    complete = train_iters is not None and step >= train_iters > 0
    said = _setting_lines("resuming", settings) + data_said
    return Launch(restart_count, source, path, {**settings, **data}, moves_aside, complete, said)


def _resume_ways_out(config: JobConfig, source: str) -> str:
    """What a refused resume can do instead: the same settings, the changes named, or, for the run
    directory's own checkpoint, a new run (--overwrite, or another run_dir); for a named checkpoint, a
    new run from its weights."""
    if source in ("latest", "auto"):
        aside = str(aside_name(config.run_dir))
        return (f"{_RESUME_WAYS_OUT}; for a new run: `overwrite` (which moves this one to {aside!r}) or "
                "another `run_dir`")  # fmt: skip
    return f"{_RESUME_WAYS_OUT}; for a new run from its weights: checkpoint.weights_only"


def _refuse_other_recipe(config: JobConfig, source: str, path: Path, recorded: Any) -> None:
    """A `ConfigError` for a checkpoint another recipe wrote (its config and weights are not this
    recipe's), naming that recipe, before any model work."""
    other = other_recipe(recorded, type(config))
    if other is None:
        return
    this = label_of(type(config))
    if source in ("latest", "auto"):
        ways_out = (f"run it with `fntrain run {other}`, or start a new run here with `overwrite` or another "
                    "`run_dir`")  # fmt: skip
    else:
        ways_out = (f"resume it with `fntrain run {other}`, or, if its model is this recipe's too, start a new "
                    f"{this} run from its weights with checkpoint.weights_only")  # fmt: skip
    raise ConfigError(f"checkpoint.restore_from {str(path)!r} was written by the {other} recipe, not {this}: {ways_out}")


def _meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json, or {} when it cannot be read (phase 2's verification says why)."""
    try:
        return read_meta(path)
    except (OSError, ValueError):
        return {}


def _setting_changes(config: JobConfig, saved: dict[str, Any] | None, subject: str,
                     ways_out: str = _RESUME_WAYS_OUT) -> dict[str, list[Any]]:  # fmt: skip
    """The setting changes continuing the run whose resolved config was `saved` (a checkpoint's, or the
    run directory's config.json) brings, allowed by checkpoint.allow_changes; any other change of a
    field that changes the numbers is a `ConfigError`: "<subject>: <each change>; <ways_out>". A path
    field naming the same file another way (relative, absolute, through a link) is no change; a change
    shows the new value as the user spelled it."""
    if not saved:
        return {}
    allowed = {name.replace("-", "_") for name in config.checkpoint.allow_changes}
    allowed.discard("data")  # the data itself, compared by its fingerprint (_data_changes)
    paths, spelled = set(path_fields(config)), flatten(config_to_dict(config))
    changes = [(name, old, spelled.get(name, new))
               for name, old, new in config_changes(saved, recorded_config(config), free=config.FREE_FIELDS)
               if not (name in paths and same_file(old, new))]  # fmt: skip
    refused = [(name, old, new) for name, old, new in changes if name not in allowed]
    if refused:
        listed = "; ".join(f"`{name}` {old!r} -> {new!r}" for name, old, new in refused)
        raise ConfigError(f"{subject}: {listed}; {ways_out}")
    return {name: [old, new] for name, old, new in changes}


def _setting_lines(doing: str, changes: dict[str, list[Any]]) -> tuple[str, ...]:
    """The warning for each allowed setting change: "<doing> with <field> changed from <old> to <new>"."""
    return tuple(f"{doing} with {name} changed from {old!r} to {new!r} (checkpoint.allow_changes)"
                 for name, (old, new) in changes.items())  # fmt: skip


def _data_changes(config: JobConfig, path: Path, saved: dict[str, Any] | None,
                  fingerprint: dict[str, Any] | None) -> tuple[dict[str, list[Any]], tuple[str, ...]]:  # fmt: skip
    """({"data": [as saved, now]}, its warning naming each changed file and fact) when the data
    `fingerprint` differs from the one the checkpoint recorded (`saved`) and `data` is in
    checkpoint.allow_changes; a `ConfigError` naming them when it is not. Nothing to compare (a
    checkpoint saved before fingerprints): ({}, ())."""
    changes = fingerprint_changes(saved, fingerprint) if saved and fingerprint is not None else []
    if not changes:
        return {}, ()
    listed = "; ".join(changes)
    if "data" not in config.checkpoint.allow_changes:
        raise ConfigError(
            f"checkpoint.restore_from {str(path)!r} was saved with other data: {listed}; resume with the "
            "same data, or add data to checkpoint.allow_changes"
        )
    said = f"resuming with changed data (checkpoint.allow_changes data): {listed}"
    return {"data": [fingerprint_summary(saved), fingerprint_summary(fingerprint)]}, (said,)


def verify_launch(config: JobConfig, launch: Launch, *, fingerprint: dict[str, Any] | None = None,
                  train_iters: int | None = None) -> Launch:  # fmt: skip
    """Phase 2 (every rank; a collective under a process group): `launch` with its checkpoint verified
    in full. A named checkpoint that is damaged is a `CheckpointDamagedError`; under latest / auto a
    damaged one is passed over for the newest good one, whose launch is decided again by the same
    rules (settings, data, completeness)."""
    if launch.source is None:
        return launch
    path = resolve_source(launch.source, checkpoint_root(config.checkpoint, config.run_dir))
    if path != launch.path:
        launch = _launch_from(config, launch.restart_count, launch.source, path, fingerprint, train_iters,
                              moves_aside=launch.moves_aside)  # fmt: skip
    for line in launch.said:
        log.warning("%s", line)
    return launch


def restore_launch(config: JobConfig, launch: Launch, built: Any, hooks: list[Any]) -> TrainState:
    """Restore the verified checkpoint of `launch` into the built components and the hooks' states
    [S36]; the TrainState to train from (a fresh one without a checkpoint). Every rank calls it."""
    if launch.path is None:
        return TrainState()
    runtime = built.runtime
    return restore(launch.path, built.components, hooks=hooks, weights_only=config.checkpoint.weights_only,
                   device=runtime.device, model_part=runtime.pp_size > 1, verified=True)  # fmt: skip
