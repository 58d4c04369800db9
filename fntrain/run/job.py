"""The run, top to bottom: `run_job(config, spec)` and `plan_job(config, spec, world_size)`.

    run_job
        check_run          phase 1: every check that needs no file written, no model, no device,
                           ending with the launch record: fresh / resume / overwrite / complete  checks.py
        setup_runtime      distributed init, device, mesh, seed (torn down on the way out)
        early_hooks        memory and profiler hooks, built once the runtime is known
        open_run           phase 2: the run directory, this rank's log, run_metadata.json  open.py
        prepare            assemble (build.py: model, data, config.json, step, hooks), the launch
                           verified and restored
        train_and_export   loop.train -> TrainResult; the exports unless a notice stopped it
        record_end         the summary line and the outcome                                finish.py
    A failure before the first finished step puts the run directory back as it was found; one after it
    records the outcome "failed". Either way the caller gets one line (`RunAborted`), or the
    `ConfigError` of a bad setting.

`plan_job` resolves the same plan without a model or a device (what `fntrain plan` prints).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from fntrain import loop
from fntrain.checkpoint.layout import checkpoint_root
from fntrain.config import ConfigError, inputs_optional
from fntrain.data.pipeline import data_fn
from fntrain.data.repeat import repeat_reads
from fntrain.data.tokens import count_batch
from fntrain.hooks.metrics_file import rewind_metrics
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.hooks.sample import SAMPLES_FILE
from fntrain.hooks.standard import early_hooks, memory_config, profiler_config
from fntrain.loop import TrainResult
from fntrain.plan.checkpoint_disk import checkpoint_size
from fntrain.plan.memory import plan_memory
from fntrain.plan.report import PlanInputs, describe_run_plan
from fntrain.run.build import Assembled, assemble
from fntrain.run.checks import (
    Checked,
    check_run,
    check_values,
    dataset_len,
    generation_shape,
    run_plan,
)
from fntrain.run.config import JobConfig, RecipeSpec
from fntrain.run.finish import (
    RunAborted,
    append_traceback,
    completed,
    export,
    failure_line,
    keep_traceback,
    record_end,
    resume_hint,
    summary_line,
)
from fntrain.run.launch import Launch, requested_source, restore_launch, verify_launch
from fntrain.run.metadata import record_start
from fntrain.run.open import OpenedRun, open_run
from fntrain.runtime.setup import setup_runtime
from fntrain.state import TrainState
from fntrain.step.layouts import choose_layout

__all__ = ["run_job", "plan_job", "RunAborted"]

log = logging.getLogger("fntrain.run.job")


def run_job(config: JobConfig, spec: RecipeSpec, *, state: TrainState | None = None) -> TrainResult:
    """Check, set up, build, restore (checkpoint.restore_from, unless `state` is given), train, export;
    return how the run ended (completed, stopped, preempted or interrupted by a notice, with its exit
    status). A bad setting is a `ConfigError` before any file, model or device work; a failure or a
    Ctrl-C is a `RunAborted` (its one line and exit status) raised from the original error."""
    checked = check_run(config, spec)
    started = time.monotonic()
    with setup_runtime(config.runtime, config.parallel, seed=config.seed) as runtime:
        early = early_hooks(config, runtime)
        opened = open_run(config, runtime, checked.launch)
        ready = None
        try:
            ready = prepare(config, spec, runtime, checked, early, opened, state)
            result, exported = train_and_export(config, ready)
            ending = "" if exported else resume_hint(config)
            summary = summary_line(config, result.outcome, result.state.global_step, time.monotonic() - started,
                                   exported=exported, ending=ending)  # fmt: skip
            record_end(config, runtime, ready.writer, result.outcome, summary, started,
                       end_state=result.state.as_dict(), allowed_changes=ready.launch.changes, exported=exported)  # fmt: skip
        except (Exception, KeyboardInterrupt) as error:
            raise ended_by(error, config, runtime, opened, ready, started) from error
        finally:
            opened.close()
    return result


@dataclass(frozen=True)
class Ready:
    """A run ready to train: what was built, its step function and hooks, the launch (verified) and
    the state it starts from."""

    assembled: Assembled
    launch: Launch
    state: TrainState

    @property
    def writer(self) -> MetricsLog:
        """The metrics log: the end of the run writes its summary there."""
        return self.assembled.wiring.writer


def prepare(config: JobConfig, spec: RecipeSpec, runtime: Any, checked: Checked, early: Any, opened: OpenedRun,
            state: TrainState | None) -> Ready:  # fmt: skip
    """Assemble the run, verify and restore the launch's checkpoint (unless `state` is given) and rewind
    the metrics log and samples.jsonl to the restored step."""
    assembled = assemble(config, spec, runtime, checked, opened, early)
    built = assembled.built
    launch = Launch(checked.launch.restart_count)
    if state is None:
        launch = verify_launch(config, checked.launch, fingerprint=checked.fingerprint,
                               train_iters=built.plan.train_iters)  # fmt: skip
        state = restore_launch(config, launch, built, assembled.wiring.hooks)
    if runtime.is_main and config.metrics.jsonl:
        moved = rewind_metrics(built.run_dir / config.metrics.jsonl_name, state.global_step)
        if moved:
            log.info("metrics: %d rows after step %d moved to the superseded log", moved, state.global_step)
    if runtime.is_main:  # the samples of those steps (a rollout's, or --sample.*'s) are written again too
        moved = rewind_metrics(built.run_dir / SAMPLES_FILE, state.global_step)
        if moved:
            log.info("samples: %d lines after step %d moved to the superseded log", moved, state.global_step)
    record_start(built.run_dir, runtime, state)
    return Ready(assembled, launch, state)


def train_and_export(config: JobConfig, ready: Ready) -> tuple[TrainResult, list[str]]:
    """Train from the ready state and export unless a notice stopped the run. A complete run trains
    nothing and writes its exports again (a run killed while exporting finishes them here)."""
    assembled, state = ready.assembled, ready.state
    built = assembled.built
    if ready.launch.complete:
        log.warning("run already complete at step %d; nothing to do", state.global_step)
        return TrainResult(state, "completed", "already complete"), export(config, assembled.export, built, state)
    data = repeat_reads(data_fn(built.data), built.plan.steps_per_read)  # a generation batch serves several steps
    counted = built.objective.count_batch if built.objective and built.objective.count_batch else count_batch
    result = loop.train(state, assembled.step.step_fn, assembled.wiring.hooks, data=data, plan=built.plan,
                        count_batch=counted)  # fmt: skip
    return result, export(config, assembled.export, built, result.state) if completed(result) else []


def ended_by(error: BaseException, config: JobConfig, runtime: Any, opened: OpenedRun, ready: Ready | None,
             started: float) -> BaseException:  # fmt: skip
    """What a run ended by `error` raises: before the first finished step the run directory is put back
    as it was (a bad setting stays a `ConfigError`); after it the outcome is recorded. Either way one
    line, with the full traceback in this rank's log (or, put back, a file in the temp directory)."""
    progress = opened.progress
    interrupted = isinstance(error, KeyboardInterrupt)
    if not progress.committed:
        opened.undo()
        if isinstance(error, ConfigError):
            return ConfigError(str(error))
        if interrupted:
            return RunAborted("run interrupted before its first step; the run directory is as it was", 130)
        return RunAborted(failure_line(error, None, keep_traceback(error, runtime.rank)) +
                          "; the run directory is as it was")  # fmt: skip
    step = progress.failed_at or progress.step
    append_traceback(opened.log_path, error)  # the file alone, not the terminal
    outcome = "interrupted" if interrupted else "failed"
    line = (summary_line(config, outcome, progress.step, time.monotonic() - started, ending=resume_hint(config))
            if interrupted else failure_line(error, step, opened.log_path))  # fmt: skip
    record_end(config, runtime, ready.writer if ready else None, outcome, line, started, error=repr(error),
               failed_at=step)  # fmt: skip
    return RunAborted(line, 130 if interrupted else 1)


def plan_job(config: JobConfig, spec: RecipeSpec, world_size: int = 1) -> dict[str, Any]:
    """The resolved run plan for `world_size` ranks (what `fntrain plan` prints): run length, batch
    shape, checkpoint steps, profiler and memory windows and the ranks that record. Builds no model and
    touches no device. It plans from the configs alone: model weights are never read, and missing data
    files are noted, not refused (the run length is then train_iters over data of unknown size); the
    data is read, with the recipe's tokenizer, only when it is there and the spec has no `dataset_sizes`.
    Strategy none over several data-parallel ranks is planned as ddp, with a note (a run refuses it)."""
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"--world-size must be a positive int, got {world_size!r}")
    config, notes = planned_strategy(config, world_size)
    with inputs_optional() as absent:
        dp_size = check_values(config, world_size, spec.objective)
        choose_layout(config.parallel).check(config, spec, dp_size)  # not check_device: plans are made off the GPU too
    if absent:
        train_len, val_len = None, 0
        notes.append(f"data not read ({'; '.join(absent)}): steps per epoch and epochs unknown")
    elif spec.dataset_sizes is not None:
        train_len, val_len = spec.dataset_sizes(config)
    else:
        assets = spec.build_assets(config) if spec.build_assets else None
        train_set, val_set = spec.build_datasets(config, assets)
        train_len, val_len = dataset_len(train_set), (len(val_set) if val_set is not None else 0)
    extra = {"val_samples": val_len, "run_dir": config.run_dir, **(spec.describe(config) if spec.describe else {}),
             "data_read": not absent, "notes": notes}  # fmt: skip
    # Built on the meta device (no weights, no device), for the model families with a tensor-parallel
    # plan or a pipeline split: the layouts the estimate knows (a VLM's factory may write its model).
    on_meta = spec.model_factory is not None and (spec.tensor_parallel is not None or spec.pipeline is not None)
    if on_meta:
        try:
            extra["memory_per_rank"] = plan_memory(config, spec.model_factory, world_size, spec.objective)
        except (ValueError, NotImplementedError, OSError) as error:  # a model it cannot count on meta
            extra["memory_per_rank"] = {"unavailable": str(error)}
    checkpoint = dataclasses.replace(config.checkpoint, dir=str(checkpoint_root(config.checkpoint, config.run_dir)))
    inputs = PlanInputs(
        world_size=world_size, pp_size=config.parallel.pp_size, parallel=config.parallel,
        device_type=config.runtime.device, dataset_len=train_len, profiler=profiler_config(config),
        memory=memory_config(config), checkpoint=checkpoint, restoring=requested_source(config) is not None,
    )  # fmt: skip
    if spec.objective is not None and spec.objective.plan is not None:
        extra.update(spec.objective.plan(config, dp_size))
    plan = run_plan(config, train_len, dp_size, generation_shape(config, spec, dp_size))
    if on_meta:  # the checkpoints' disk, from the model's size (built on meta, as the memory estimate)
        evaluates = val_len > 0 and config.evaluate.resolved(True, plan.train_iters).enabled
        try:
            inputs = dataclasses.replace(inputs, checkpoint_bytes=checkpoint_size(config, spec.model_factory),
                                         evaluates=evaluates)  # fmt: skip
        except (ValueError, NotImplementedError, OSError):  # a model it cannot count on meta: no disk line
            pass
    return describe_run_plan(plan, inputs, extra)


def planned_strategy(config: JobConfig, world_size: int) -> tuple[JobConfig, list[str]]:
    """`config` with strategy none over several data-parallel ranks replaced by ddp, and a note saying
    so: asked for a world size, a plan shows that world (a run keeps refusing none, naming the flag)."""
    parallel = config.parallel
    model_parallel = parallel.tp_size * parallel.pp_size * parallel.cp_size
    if parallel.strategy != "none" or world_size % model_parallel or world_size // model_parallel < 2:
        return config, []
    note = (f"--parallel.strategy none cannot train {world_size // model_parallel} data-parallel ranks: planned "
            "as ddp; pass --parallel.strategy ddp (or fsdp2) to run it")  # fmt: skip
    return dataclasses.replace(config, parallel=dataclasses.replace(parallel, strategy="ddp")), [note]
