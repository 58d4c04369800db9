"""Profiler hook [S34]: a window of steps traced on chosen ranks with torch.profiler or torch_npu.profiler.

`profiler_hook(config, runtime)` checks and normalises `config` at once (before any model or device
work) and returns a hook. The window is counted in steps of this run (1-based, inclusive), never in
restored global steps: steps `start_step..stop_step` are recorded, one trace is written when the window
closes, and a trace viewer shows them as `ProfilerStep#<k>` (k = step of this run). The session is stopped
after `stop_step`, at TRAIN_END (the partial window is written) or at ABORT (no trace is written; on npu
the raw folder torch_npu fills while recording stays, unparsed).

Traces go to `<output_path or ./output>/profile/rank_<global rank>/`. On cpu/cuda they are
`rank_<r>.<ns>.pt.trace.json` Chrome traces (torch.profiler.tensorboard_trace_handler) that open in
https://ui.perfetto.dev and in TensorBoard's profiler plugin (`--logdir <output>/profile`). On npu,
torch_npu writes its `*_ascend_pt` folders (for MindStudio Insight / msprof-analyze) with the
experimental config (level, data simplification, mstx, text export). The parallel layout is recorded once
per window as the `distributed_args` metadata (cluster analysis tools read it).

Outside the window a step costs the hook two integer comparisons: the profiler object is created and
started when the window opens (at TRAIN_BEGIN with `start_on_init`), and its schedule position is set to
the step before the window so that its `skip_first` counts steps of this run without stepping the
profiler through every earlier step.

The backend is one seam, `_resolve_backend(device_type)`, called at TRAIN_BEGIN on profiled ranks only:
it imports `torch.profiler` (cpu, cuda) or `torch_npu.profiler` (npu) and nothing else; tests replace it
or put a stand-in `torch_npu` into `sys.modules`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fntrain.config import require_bool, require_int, require_str
from fntrain.loop import Event, Hook
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["ProfilerConfig", "profiler_hook", "check_profiler_config", "profiled_ranks"]

log = logging.getLogger("fntrain.hooks.profiler")

_DEVICES = ("cpu", "cuda", "npu")
_LEVELS = (0, 1, 2)
_DEFAULT_START, _DEFAULT_STOP = 1, 10
_BOOL_FIELDS = (
    "enabled",
    "start_on_init",
    "memory",
    "pipeline_stage_leaders",
    "with_stack",
    "data_simplification",
    "mstx",
    "record_shapes",
)


@dataclass(frozen=True)
class ProfilerConfig:
    """When, where and what to profile [S34]. Steps are steps of this run, 1-based and inclusive."""

    enabled: bool = False
    """Profile a window of steps (off: the hook does nothing and imports no profiler)."""
    start_step: int = 1
    """First step of this run to record (< 1 becomes 1)."""
    stop_step: int = 10
    """Last step of this run to record; the trace is written after it (< 1 becomes 10)."""
    start_on_init: bool = False
    """Create and start the profiler session at TRAIN_BEGIN instead of at the first window step
    (needs start_step 1; otherwise turned off with a warning)."""
    memory: bool = True
    """Record tensor allocations (profile_memory)."""
    rank_ids: list[int] | None = None
    """Global ranks to profile; with pipeline_stage_leaders, the union. None or empty (and no leaders):
    every rank."""
    pipeline_stage_leaders: bool = False
    """Also profile the first rank of each pipeline stage (ranks s * world_size / pp_size)."""
    output_path: str | None = None
    """Root for traces: <output_path>/profile/rank_<rank>/ (None: ./output; the recipes use the run dir)."""
    level: int | None = 1
    """NPU profiler level 0, 1 or 2 (more detail, more overhead); None means 0. Ignored on cpu/cuda."""
    with_stack: bool = False
    """Record Python stacks of operators (large traces)."""
    data_simplification: bool = False
    """NPU: drop intermediate raw data after export."""
    mstx: bool = False
    """NPU: collect mstx ranges and mark each profiled step with a range "step <N>", N the global step
    the step produces (the global_step its STEP_END sees)."""
    record_shapes: bool = False
    """Record operator input shapes."""

    def validate(self, prefix: str = "profiler") -> None:
        """The type rules (`TypeError` naming the dotted field); needs no runtime, touches nothing.

        The value rules that need the runtime (rank range, stages, device) and the normalisation live
        in `check_profiler_config`, which `profiler_hook` calls.
        """
        for name in _BOOL_FIELDS:
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_int(f"{prefix}.start_step", self.start_step)
        require_int(f"{prefix}.stop_step", self.stop_step)
        require_str(f"{prefix}.output_path", self.output_path, optional=True)
        if self.rank_ids is not None and not isinstance(self.rank_ids, (list, tuple)):
            raise TypeError(f"{prefix}.rank_ids must be a list of ints or None, got {self.rank_ids!r}")
        if self.level is not None and type(self.level) is not int:
            raise TypeError(f"{prefix}.level must be an int (0, 1 or 2) or None, got {self.level!r}")


def check_profiler_config(
    config: ProfilerConfig, runtime: Runtime, *, prefix: str = "profiler"
) -> ProfilerConfig:
    """Validate `config` for `runtime` and return it normalised; touches no device, imports nothing.

    Types are checked even when disabled (`TypeError` naming the dotted field); the rest only when
    enabled: rank ids in [0, world_size) and a world size divisible by the pipeline stages (`ValueError`),
    a device other than cpu/cuda/npu (`RuntimeError`), mstx off NPU (`ValueError`). Out-of-range windows,
    `start_on_init` with a later start and bad levels are normalised with a `UserWarning`.
    """
    if not isinstance(config, ProfilerConfig):
        raise TypeError(f"{prefix} must be a ProfilerConfig, got {type(config).__name__}")
    config.validate(prefix)
    if not config.enabled:
        return config

    world = runtime.world_size
    if config.rank_ids is not None:
        bad = [r for r in config.rank_ids if type(r) is not int or not 0 <= r < world]
        if bad:
            raise ValueError(
                f"{prefix}.rank_ids must contain integers in [0, {world}), got {list(config.rank_ids)!r}"
            )
    if config.pipeline_stage_leaders:
        _stage_leaders(world, runtime.pp_size, prefix)  # raises when the stages do not divide the world
    device_type = _device_type(runtime.device)
    if device_type not in _DEVICES:
        raise RuntimeError(
            f"{prefix}: profiling needs a cpu, cuda or npu device (torch.profiler / torch_npu.profiler), "
            f"got {str(runtime.device)!r}"
        )
    if config.mstx and device_type != "npu":
        raise ValueError(f"{prefix}.mstx needs an npu device (mstx ranges are Ascend's), got {device_type!r}")

    start, stop = config.start_step, config.stop_step
    if start < 1:
        _warn(f"{prefix}.start_step must be >= 1, got {start}; using {_DEFAULT_START}")
        start = _DEFAULT_START
    if stop < 1:
        _warn(f"{prefix}.stop_step must be >= 1, got {stop}; using {_DEFAULT_STOP}")
        stop = _DEFAULT_STOP
    if start > stop:
        _warn(
            f"{prefix}.start_step ({start}) is after {prefix}.stop_step ({stop}); "
            f"using the default window {_DEFAULT_START}..{_DEFAULT_STOP}"
        )
        start, stop = _DEFAULT_START, _DEFAULT_STOP
    start_on_init = config.start_on_init
    if start_on_init and start != 1:
        _warn(f"{prefix}.start_on_init needs {prefix}.start_step 1, got {start}; turning start_on_init off")
        start_on_init = False
    level = config.level
    if level is None:
        _warn(f"{prefix}.level is None; using 0")
        level = 0
    elif level not in _LEVELS:
        _warn(f"{prefix}.level must be 0, 1 or 2, got {level}; using 0")
        level = 0
    return dataclasses.replace(
        config, start_step=start, stop_step=stop, start_on_init=start_on_init, level=level
    )


def profiled_ranks(config: ProfilerConfig, world_size: int, pp_size: int = 1) -> frozenset[int]:
    """The global ranks that profile: `rank_ids` ∪ pipeline-stage leaders; both empty: every rank."""
    selected = set(config.rank_ids or ())
    if config.pipeline_stage_leaders:
        selected.update(_stage_leaders(world_size, pp_size, "profiler"))
    return frozenset(selected) if selected else frozenset(range(world_size))


def profiler_hook(config: ProfilerConfig, runtime: Runtime) -> Hook:
    """The profiler hook for `runtime` (put it after gc and before checkpoint in the hook list).

    Checks and normalises `config` now (see `check_profiler_config`). Disabled, or on a rank that is not
    selected, the hook does nothing: no backend is resolved and no profiler module imported.
    """
    config = check_profiler_config(config, runtime)
    if not config.enabled or runtime.rank not in profiled_ranks(config, runtime.world_size, runtime.pp_size):
        return _inactive
    return _make_profiler_hook(config, runtime)


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The profiler hook when disabled or on an unselected rank: nothing happens."""


# ----------------------------------------------------------------------------- the hook


def _make_profiler_hook(config: ProfilerConfig, runtime: Runtime) -> Hook:
    device_type = _device_type(runtime.device)
    start, stop = config.start_step, config.stop_step
    trace_dir = os.path.join(
        os.path.abspath(os.path.expanduser(config.output_path or "./output")),
        "profile",
        f"rank_{runtime.rank}",
    )
    worker_name = f"rank_{runtime.rank}"
    distributed_args = json.dumps(_distributed_args(runtime))

    backend: _Backend | None = None
    session: Any = None  # the profile object while a session is open
    began = False  # TRAIN_BEGIN ran and the session of this run has not ended
    done = 0  # steps of this run completed
    exporting = False  # whether a trace that becomes ready is written (False while aborting)
    metadata_recorded = False
    open_range: Any = None  # the mstx range id of the step in progress

    def on_trace_ready(prof: Any, write: Callable[[Any], None]) -> None:
        if not exporting:
            return
        try:
            write(prof)
        except Exception as error:  # noqa: BLE001 - a lost trace must not end the training run
            log.error("profiler: writing the trace to %s failed: %r", trace_dir, error)
        else:
            log.info("profiler: trace of steps %d..%d written to %s", start, min(done, stop), trace_dir)

    def open_session() -> None:
        nonlocal session, exporting
        assert backend is not None
        profiler = backend.profiler
        write = profiler.tensorboard_trace_handler(trace_dir, worker_name=worker_name)
        activities = [profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(profiler.ProfilerActivity.CUDA)
        elif device_type == "npu":
            activities.append(profiler.ProfilerActivity.NPU)
        with warnings.catch_warnings():
            # The window is exact by design (skip_first = start, active = stop - start + 1): no warmup.
            warnings.filterwarnings("ignore", message=".*warmup.*")
            schedule = profiler.schedule(
                wait=0, warmup=0, active=stop - start + 1, repeat=1, skip_first=start
            )
        kwargs: dict[str, Any] = dict(
            activities=activities,
            schedule=schedule,
            on_trace_ready=lambda prof: on_trace_ready(prof, write),
            record_shapes=config.record_shapes,
            profile_memory=config.memory,
            with_stack=config.with_stack,
        )
        if device_type == "npu":
            kwargs["experimental_config"] = _npu_experimental_config(profiler, config)
        prof = profiler.profile(**kwargs)
        # The schedule counts profiler steps; the session opens just before step `start` of this run (or
        # at TRAIN_BEGIN, step 0, with start_on_init), so its position is set to the step before: the next
        # `step()` is step `start`, recorded and marked ProfilerStep#<start>, and no profiler call is made
        # on the steps before the window. torch.profiler.profile and torch_npu's both keep it in `step_num`.
        prof.step_num = start - 1
        session, exporting = prof, True
        log.info(
            "profiler: rank %d records steps %d..%d of this run into %s", runtime.rank, start, stop, trace_dir
        )
        prof.start()

    def record_metadata() -> None:
        nonlocal metadata_recorded
        metadata_recorded = True
        try:
            session.add_metadata_json("distributed_args", distributed_args)
        except Exception as error:  # noqa: BLE001 - metadata is a nicety, never a reason to fail
            log.warning("profiler: could not record the distributed_args metadata: %r", error)

    def end_range() -> None:
        nonlocal open_range
        if open_range is not None:
            range_id, open_range = open_range, None
            assert backend is not None and backend.mstx is not None
            backend.mstx.range_end(range_id)

    def finish(export: bool) -> None:
        """End the session once: write the window (or its recorded part) when `export`, else nothing."""
        nonlocal session, began, exporting
        began = False
        prof, session = session, None
        if prof is None:
            return
        exporting = export
        try:
            end_range()
        finally:
            try:
                if export and done >= stop:
                    # The window's last step completed: close the cycle as the schedule does (this writes
                    # the trace), so the stop below finds nothing left to do.
                    prof.step()
                prof.stop()
            finally:
                exporting = False

    def step_begin(state: TrainState) -> None:
        nonlocal open_range
        if not began:
            return
        if session is None:
            open_session()
        session.step()
        if not metadata_recorded:
            record_metadata()
        if config.mstx:
            assert backend is not None and backend.mstx is not None
            open_range = backend.mstx.range_start(f"step {state.global_step + 1}", None)

    def step_end() -> None:
        if session is None:
            return
        end_range()
        if done == stop:
            finish(export=True)

    def train_begin() -> None:
        nonlocal backend, began, done, metadata_recorded, open_range
        if session is not None:  # a previous run on this hook neither ended nor aborted
            finish(export=False)
        done, metadata_recorded, open_range = 0, False, None
        backend = _resolve_backend(device_type)
        began = True
        if config.start_on_init:
            open_session()

    def abort(error: Any) -> None:
        try:
            finish(export=False)
        except Exception as stop_error:  # noqa: BLE001 - ABORT must not hide the original error
            log.error("profiler: stopping the session after %r raised %r", error, stop_error)

    def profiler(event: Event, state: TrainState, info: Any) -> None:
        nonlocal done
        if event is Event.STEP_BEGIN:
            if start <= done + 1 <= stop:
                step_begin(state)
        elif event is Event.STEP_END:
            done += 1
            if start <= done <= stop:
                step_end()
        elif event is Event.TRAIN_BEGIN:
            train_begin()
        elif event is Event.TRAIN_END:
            finish(export=True)
        elif event is Event.ABORT:
            abort(info)

    return profiler


# ----------------------------------------------------------------------------- backends


class _Backend(NamedTuple):
    """The profiler module (torch.profiler or torch_npu.profiler) and, on npu, torch_npu.npu.mstx."""

    profiler: Any
    mstx: Any = None


def _resolve_backend(device_type: str) -> _Backend:
    """Import the profiler for `device_type`: torch_npu only for npu, and only here (never at import)."""
    if device_type == "npu":
        from fntrain.runtime.device import import_npu_module, import_torch_npu

        npu_profiler = import_npu_module("profiler")
        return _Backend(npu_profiler, getattr(getattr(import_torch_npu(), "npu", None), "mstx", None))
    if device_type in ("cpu", "cuda"):
        return _Backend(importlib.import_module("torch.profiler"))
    raise RuntimeError(f"profiler: no profiler backend for device type {device_type!r}")


def _npu_experimental_config(npu_profiler: Any, config: ProfilerConfig) -> Any:
    """torch_npu's experimental config: level, data simplification, mstx, text export."""
    make = npu_profiler._ExperimentalConfig
    kwargs: dict[str, Any] = dict(
        profiler_level=getattr(npu_profiler.ProfilerLevel, f"Level{config.level}"),
        data_simplification=config.data_simplification,
        export_type=npu_profiler.ExportType.Text,
    )
    # torch_npu >= 2.1.0.post10 calls the switch `mstx`; older releases `msprof_tx`.
    try:
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):
        params = {}
    if "mstx" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs["mstx"] = config.mstx
    elif "msprof_tx" in params:
        kwargs["msprof_tx"] = config.mstx
    else:
        kwargs["mstx"] = config.mstx
    return make(**kwargs)


# ----------------------------------------------------------------------------- helpers


def _stage_leaders(world_size: int, pp_size: int, prefix: str) -> list[int]:
    stages = max(1, pp_size)
    if world_size % stages:
        raise ValueError(
            f"{prefix}.pipeline_stage_leaders: the world size ({world_size}) must be divisible by the "
            f"number of pipeline stages ({stages})"
        )
    per_stage = world_size // stages
    return [stage * per_stage for stage in range(stages)]


def _distributed_args(runtime: Runtime) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": runtime.tp_size,
        "pipeline_model_parallel_size": runtime.pp_size,
        "data_parallel_size": runtime.dp_size,
        "context_parallel_size": runtime.cp_size,
        "expert_model_parallel_size": runtime.ep_size,
        "world_size": runtime.world_size,
        "parallel_mode": runtime.parallel_mode,
        "rank": runtime.rank,
    }


def _device_type(device: Any) -> str:
    device_type = getattr(device, "type", None)
    return device_type if isinstance(device_type, str) else str(device).split(":", 1)[0]


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=3)
