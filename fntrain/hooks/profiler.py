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

Outside the window a step costs the hook two integer comparisons: the profiler is created and started
when the window opens, positioned so that it is never stepped before the window. With `start_on_init`
the session opens at TRAIN_BEGIN and records from there: its first profiler step (`ProfilerStep#1`)
begins at TRAIN_BEGIN, so it holds the init phase (what the hooks after the profiler do at TRAIN_BEGIN,
e.g. the restore, and the first batch fetch) followed by step 1. On npu with `mstx`, each profiled step
is an mstx range "step <N>" started on the current NPU stream, so it shows on the device timeline too.

This module decides when and on which ranks; `fntrain.runtime.profiling` owns the sessions and the
backend seam, `resolve_backend(device_type)`, called at TRAIN_BEGIN on profiled ranks only: it imports
`torch.profiler` (cpu, cuda) or `torch_npu.profiler` (npu) and nothing else; tests replace it or put a
stand-in `torch_npu` into `sys.modules`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

from fntrain.config import ConfigError, require_bool, require_int, require_str
from fntrain.hooks.base import on_ranks
from fntrain.loop import Event, Hook
from fntrain.mesh_layout import stage_leaders
from fntrain.runtime import profiling
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["ProfilerConfig", "profiler_hook", "check_profiler_config", "profiled_ranks"]

log = logging.getLogger("fntrain.hooks.profiler")

_LEVELS = (0, 1, 2)
_DEFAULT_START, _DEFAULT_STOP = 1, 10
_BOOL_FIELDS = (
    "enabled", "start_on_init", "memory", "pipeline_stage_leaders", "with_stack", "data_simplification",
    "mstx", "record_shapes",
)  # fmt: skip


@dataclass(frozen=True)
class ProfilerConfig:
    """When, where and what to profile. Steps are steps of this run, 1-based and inclusive."""

    enabled: bool = False
    """Profile a window of steps (off: the hook does nothing and imports no profiler)."""
    start_step: int = 1
    """First step of this run to record (< 1 becomes 1)."""
    stop_step: int = 10
    """Last step of this run to record; the trace is written after it (< 1 becomes 10)."""
    start_on_init: bool = False
    """Start recording at TRAIN_BEGIN to trace the init phase too (needs start_step 1, else ignored)."""
    memory: bool = True
    """Record tensor allocations (profile_memory)."""
    rank_ids: list[int] | None = None
    """Global ranks to profile, with the pipeline stage leaders if set; None or empty: every rank."""
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
    """NPU: collect mstx ranges and mark each profiled step as a range "step <global_step>"."""
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
        if self.enabled is True and 1 <= self.stop_step < self.start_step:  # steps < 1 are normalised later
            _reversed_window(prefix, self.start_step, self.stop_step)
        require_str(f"{prefix}.output_path", self.output_path, optional=True)
        if self.rank_ids is not None:
            if not isinstance(self.rank_ids, (list, tuple)):
                raise TypeError(f"{prefix}.rank_ids must be a list of ints or None, got {self.rank_ids!r}")
            if any(type(r) is not int or r < 0 for r in self.rank_ids):
                raise ValueError(f"{prefix}.rank_ids must contain integers >= 0, got {list(self.rank_ids)!r}")
        if self.level is not None and type(self.level) is not int:
            raise TypeError(f"{prefix}.level must be an int (0, 1 or 2) or None, got {self.level!r}")


def _reversed_window(prefix: str, start: int, stop: int) -> None:
    """A window that ends before it starts records nothing: a setting error, as for the memory hook."""
    raise ConfigError(f"{prefix}.stop_step must be >= {prefix}.start_step ({start}), got {stop}")


def check_profiler_config(
    config: ProfilerConfig, runtime: Runtime, *, prefix: str = "profiler"
) -> ProfilerConfig:
    """Validate `config` for `runtime` and return it normalised; touches no device, imports nothing.

    Types are checked even when disabled (`TypeError` naming the dotted field); the rest only when
    enabled: rank ids in [0, world_size) and a world size divisible by the pipeline stages (`ValueError`),
    a device other than cpu/cuda/npu (`RuntimeError`), mstx off NPU (`ValueError`), a window whose stop
    is before its start (`ConfigError`). Steps < 1, `start_on_init` with a later start and bad levels
    are normalised with a `UserWarning`.
    """
    if not isinstance(config, ProfilerConfig):
        raise TypeError(f"{prefix} must be a ProfilerConfig, got {type(config).__name__}")
    world = runtime.world_size
    if config.enabled is True and isinstance(config.rank_ids, (list, tuple)):
        # Enabled, the rank ids are checked against the world first: the error names the range.
        bad = [r for r in config.rank_ids if type(r) is not int or not 0 <= r < world]
        if bad:
            raise ValueError(
                f"{prefix}.rank_ids must contain integers in [0, {world}), got {list(config.rank_ids)!r}"
            )
    config.validate(prefix)
    if not config.enabled:
        return config

    if config.pipeline_stage_leaders:
        _stage_leaders(world, runtime.pp_size, prefix)  # raises when the stages do not divide the world
    profiling.check_device(runtime.device, mstx=config.mstx, prefix=prefix)
    return _normalised(config, prefix)


def _normalised(config: ProfilerConfig, prefix: str) -> ProfilerConfig:
    """Steps < 1, `start_on_init` with a later start and bad levels replaced, with a `UserWarning`."""
    start, stop = config.start_step, config.stop_step
    if start < 1:
        _warn(f"{prefix}.start_step must be >= 1, got {start}; using {_DEFAULT_START}")
        start = _DEFAULT_START
    if stop < 1:
        _warn(f"{prefix}.stop_step must be >= 1, got {stop}; using {_DEFAULT_STOP}")
        stop = _DEFAULT_STOP
    if start > stop:  # a window a user typed backwards, or a start past the default stop
        _reversed_window(prefix, start, stop)
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
    if not config.enabled:
        return _inactive
    ranks = profiled_ranks(config, runtime.world_size, runtime.pp_size)
    return on_ranks(ranks, runtime.rank, _window_hook(_trace_spec(config, runtime)))  # resolves nothing


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The profiler hook when disabled or on an unselected rank: nothing happens."""


def _stage_leaders(world_size: int, pp_size: int, prefix: str) -> list[int]:
    stages = max(1, pp_size)
    if world_size % stages:
        raise ValueError(
            f"{prefix}.pipeline_stage_leaders: the world size ({world_size}) must be divisible by the "
            f"number of pipeline stages ({stages})"
        )
    # The same rank -> coordinates arithmetic as the runtime mesh and the plan printout (pp outermost).
    return stage_leaders(world_size, stages)


def _warn(message: str) -> None:
    warnings.warn(message, UserWarning, stacklevel=4)  # the caller of check_profiler_config


def _trace_spec(config: ProfilerConfig, runtime: Runtime) -> profiling.TraceSpec:
    """This rank's window and trace options from the normalised `config`."""
    root = os.path.abspath(os.path.expanduser(config.output_path or "./output"))
    return profiling.TraceSpec(
        device_type=profiling.device_type_of(runtime.device),
        start=config.start_step,
        stop=config.stop_step,
        start_on_init=config.start_on_init,
        trace_dir=os.path.join(root, "profile", f"rank_{runtime.rank}"),
        rank=runtime.rank,
        distributed_args=json.dumps(profiling.distributed_args(runtime)),
        record_shapes=config.record_shapes,
        profile_memory=config.memory,
        with_stack=config.with_stack,
        level=config.level,
        data_simplification=config.data_simplification,
        mstx=config.mstx,
    )


# ----------------------------------------------------------------------------- the hook


@dataclass(slots=True)
class _Profiler:
    """What the profiler hook keeps between events."""

    backend: profiling.ProfilerBackend | None = None  # resolved at TRAIN_BEGIN (the first import)
    session: profiling.TraceSession | None = None  # open from the window's first step to its end
    began: bool = False  # TRAIN_BEGIN ran and the session of this run has not ended
    done: int = 0  # steps of this run completed


def _window_hook(spec: profiling.TraceSpec) -> Hook:
    """The hook of a profiled rank. Outside the window a step costs two integer comparisons."""
    memory = _Profiler()
    start, stop = spec.start, spec.stop

    def profiler(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_BEGIN:
            if start <= memory.done + 1 <= stop:
                _step_begin(spec, memory, state)
        elif event is Event.STEP_END:
            memory.done += 1
            if start <= memory.done <= stop:
                _step_end(spec, memory)
        elif event is Event.TRAIN_BEGIN:
            _train_begin(spec, memory)
        elif event is Event.TRAIN_END:
            _finish(memory, export=True)
        elif event is Event.ABORT:
            _abort(memory, info)

    return profiler


def _train_begin(spec: profiling.TraceSpec, memory: _Profiler) -> None:
    if memory.session is not None:  # a previous run on this hook neither ended nor aborted
        _finish(memory, export=False)
    memory.done = 0
    memory.backend = profiling.resolve_backend(spec.device_type)
    if spec.mstx and memory.backend.current_stream is None:
        log.warning(
            "profiler: this torch_npu has no npu.current_stream; mstx ranges are marked on the host only"
        )
    memory.began = True
    if spec.start_on_init:
        _open(spec, memory, init=True)


def _open(spec: profiling.TraceSpec, memory: _Profiler, *, init: bool = False) -> None:
    assert memory.backend is not None
    # Kept before it starts, so that ABORT stops a session whose start failed half-way.
    memory.session = profiling.TraceSession(memory.backend, spec, log)
    memory.session.start(init=init)


def _step_begin(spec: profiling.TraceSpec, memory: _Profiler, state: TrainState) -> None:
    if not memory.began:
        return
    if memory.session is None:
        _open(spec, memory)
    memory.session.begin_step(state.global_step + 1)


def _step_end(spec: profiling.TraceSpec, memory: _Profiler) -> None:
    if memory.session is None:
        return
    memory.session.end_step()
    if memory.done == spec.stop:
        _finish(memory, export=True)


def _finish(memory: _Profiler, *, export: bool) -> None:
    """End the session once: write the window (or its recorded part) when `export`, else nothing."""
    memory.began = False
    session, memory.session = memory.session, None
    if session is not None:
        session.finish(export=export, done=memory.done)


def _abort(memory: _Profiler, error: Any) -> None:
    try:
        _finish(memory, export=False)
    except Exception as stop_error:  # noqa: BLE001 - ABORT must not hide the original error
        log.error("profiler: stopping the session after %r raised %r", error, stop_error)
