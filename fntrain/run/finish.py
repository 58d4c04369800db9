"""How a run ends: the exports, one summary line, one recorded outcome, for every ending.

    export(config, spec, built, state)      the spec's export and model.safetensors (checkpoint.export)
    summary_line(...)                       steps, tokens, wall time, losses, where the weights went
    record_end(...)                         the summary to the log, the trackers and run_metadata.json
    RunAborted                              a run that ended by a failure or Ctrl-C: its one line and
                                            exit status (1, or 130), raised from the original error
    failure_line(error, step, log)          "run failed at step N: <what>; full traceback in <log>"
    keep_traceback(error, rank)             a failure before the first step leaves the run directory as
                                            it was: its traceback goes to a file in the temp directory

Set FNTRAIN_TRACEBACK=1 to have the CLI print the full traceback too.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from fntrain.checkpoint import export_safetensors, find_latest
from fntrain.checkpoint.export import ExportError, export_failure
from fntrain.checkpoint.layout import checkpoint_root
from fntrain.hooks.metrics_file import summarize_metrics
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.loop import TrainResult
from fntrain.run.config import Built, JobConfig
from fntrain.run.launch import requested_source
from fntrain.run.logs import FILE_ONLY
from fntrain.run.metadata import record_outcome
from fntrain.runtime.groups import pipeline_group
from fntrain.state import TrainState

__all__ = ["RunAborted", "export", "summary_line", "record_end", "failure_line", "keep_traceback", "append_traceback", "what_happened"]

log = logging.getLogger("fntrain.run.job")

TRACEBACK_ENV = "FNTRAIN_TRACEBACK"


class RunAborted(Exception):
    """A run ended by a failure (exit status 1) or a Ctrl-C that saved nothing (130), after its outcome
    was recorded; `line` is what the user reads, `__cause__` the original error."""

    def __init__(self, line: str, exit_code: int = 1):
        super().__init__(line)
        self.line, self.exit_code = line, exit_code


def export(config: JobConfig, recipe_export: Any, built: Built, state: TrainState) -> list[str]:
    """The recipe's export (`recipe_export(built, state)`, None: none), and <run_dir>/model.safetensors
    when checkpoint.export is set; where they went."""
    written = []
    try:
        if recipe_export is not None:
            written.append(recipe_export(built, state))
        if config.checkpoint.export:
            path = built.run_dir / "model.safetensors"  # a collective under FSDP2 (every rank gathers), rank 0 writes
            export_safetensors(built.components.model, path, metadata=state.as_dict(),
                               pipeline_group=pipeline_group(built.runtime))  # fmt: skip
            written.append(path)
    except Exception as error:  # the line says what is kept and what is lost
        raise export_failure(error, step=state.global_step,
                             checkpoints=checkpoint_root(config.checkpoint, built.run_dir)) from error  # fmt: skip
    return [str(path) for path in written if path is not None]


def summary_line(config: JobConfig, outcome: str, step: int | None, seconds: float, *,
                 exported: list[str] = (), ending: str = "") -> str:  # fmt: skip
    """One line saying how the run ended: steps, tokens, wall time, the last logged loss and the steps it
    is the mean of, the best validation loss, where the weights went (or `ending`: how to go on)."""
    facts = summarize_metrics(Path(config.run_dir).expanduser() / config.metrics.jsonl_name)
    parts = [f"run {outcome} at step {step}" if step is not None else f"run {outcome} before its first step"]
    if "consumed_tokens" in facts:
        parts.append(f"{facts['consumed_tokens']:,} tokens")
    parts.append(f"{seconds:.1f} s")
    if "loss" in facts:  # the last metrics line's `loss`, named for what it is: a mean over its window
        first, last = facts["loss_steps"]
        window = f"step {last}" if first == last else f"mean of steps {first}-{last}"
        parts.append(f"loss {facts['loss']:.4g} ({window})")
    if "best_val_loss" in facts:
        parts.append(f"best val_loss {facts['best_val_loss']:.4g} (step {facts['best_val_step']})")
    if exported:
        parts.append("weights in " + ", ".join(exported))
    elif ending:
        parts.append(ending)
    return "; ".join(parts)


def resume_hint(config: JobConfig) -> str:
    """How to go on after a run that stopped early: only an action that will work (resuming needs a
    complete checkpoint; a rerun of the same command resumes unless checkpoint.restore_from is none)."""
    latest = find_latest(checkpoint_root(config.checkpoint, config.run_dir))
    if latest is None and config.checkpoint.enabled:  # stopped before the first save was due
        return "no checkpoint was saved yet (--checkpoint.save-on-interrupt saves at a Ctrl-C)"
    if latest is None:
        return "no checkpoint was saved (set --checkpoint.save-every to make one)"
    if requested_source(config) in ("latest", "auto"):
        return f"run the same command again to resume from {latest.name}"
    without = " and without --overwrite" if config.overwrite else ""
    return f"resume from {latest.name} with --checkpoint.restore-from latest{without}"


def record_end(config: JobConfig, runtime: Any, writer: MetricsLog | None, outcome: str, summary: str,
               started: float, **details: Any) -> None:  # fmt: skip
    """The summary line on the main rank's log, the trackers' end of the story (the run's metrics log
    `writer`, None when the run failed before building it), and the outcome in run_metadata.json. A run
    that did not finish ends the command with a line of its own (the CLI's, `fntrain.cli.final_line`):
    its summary goes to the log file, not the console too."""
    if runtime.is_main:
        if outcome in ("completed", "stopped"):
            log.info("%s", summary)
        else:
            log.warning("%s", summary, extra=FILE_ONLY)
    if writer is not None:
        writer.summary({"outcome": outcome, "wall_s": round(time.monotonic() - started, 1),
                        "exported": ", ".join(details.get("exported") or ())})  # fmt: skip
    record_outcome(config.run_dir, runtime, outcome, summary=summary, **details)


def what_happened(error: BaseException) -> str:
    """The error in a few words: its type and the first line of its message."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def failure_line(error: BaseException, step: int | None, traceback_at: Path | str) -> str:
    """The one line a failed run leaves on the terminal."""
    if isinstance(error, ExportError):  # "at step 6 exporting hf_model: ...; what is kept and lost"
        return f"run failed at step {error.step} {error.line}; full traceback in {traceback_at}"
    where = f"at step {step}" if step is not None else "before its first step"
    return f"run failed {where}: {what_happened(error)}; full traceback in {traceback_at}"


def _traceback_text(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def append_traceback(path: Path, error: BaseException) -> None:
    """Append `error`'s traceback to the log file `path`."""
    with open(path, "a", encoding="utf-8") as file:
        file.write(_traceback_text(error))


def keep_traceback(error: BaseException, rank: int) -> Path:
    """Write `error`'s traceback to a file in the temp directory (the run directory is being put back
    as it was); return its path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    fd, name = tempfile.mkstemp(prefix=f"fntrain-failed-{stamp}-rank{rank}-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(_traceback_text(error))
    return Path(name)


def completed(result: TrainResult) -> bool:
    """Whether the run ended by reaching its length (or a hook's stop), not by a notice."""
    return result.outcome not in ("preempted", "interrupted")
