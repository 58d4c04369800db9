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

This module decides when; `fntrain.hooks.profiler_config` holds the settings, their checks and which
ranks profile (`ProfilerConfig`, `check_profiler_config`, `profiled_ranks`, re-exported here), and
`fntrain.runtime.profiling` owns the sessions and the backend seam, `resolve_backend(device_type)`,
called at TRAIN_BEGIN on profiled ranks only: it imports `torch.profiler` (cpu, cuda) or
`torch_npu.profiler` (npu) and nothing else; tests replace it or put a stand-in `torch_npu` into
`sys.modules`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from fntrain.hooks.base import on_ranks
from fntrain.hooks.profiler_config import ProfilerConfig, check_profiler_config, profiled_ranks
from fntrain.loop import Event, Hook
from fntrain.runtime import profiling
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["ProfilerConfig", "profiler_hook", "check_profiler_config", "profiled_ranks"]

log = logging.getLogger("fntrain.hooks.profiler")


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
