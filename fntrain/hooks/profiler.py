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
started when the window opens, and its schedule position is set to the step before the window so that its
`skip_first` counts steps of this run without stepping the profiler through every earlier step. With
`start_on_init` the session opens at TRAIN_BEGIN and records from there: its first profiler step
(`ProfilerStep#1`) begins at TRAIN_BEGIN, so it holds the init phase (what the hooks after the profiler
do at TRAIN_BEGIN, e.g. the restore, and the first batch fetch) followed by step 1.

On npu with `mstx`, each profiled step is an mstx range "step <N>" started on the current NPU stream, so
it shows on the device timeline as well as the host's.

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

from fntrain.config import ConfigError, require_bool, require_int, require_str
from fntrain.hooks.base import on_ranks
from fntrain.loop import Event, Hook
from fntrain.mesh_layout import stage_leaders
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
    return on_ranks(ranks, runtime.rank, _make_profiler_hook(config, runtime))  # building it resolves nothing


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The profiler hook when disabled or on an unselected rank: nothing happens."""


# ----------------------------------------------------------------------------- the hook


@dataclass(frozen=True)
class _Setup:
    """What the hook was built with (never changes)."""

    config: ProfilerConfig
    runtime: Runtime
    device_type: str
    start: int  # first and last step of the window (steps of this run, 1-based, inclusive)
    stop: int
    trace_dir: str
    worker_name: str
    distributed_args: str  # JSON


@dataclass(slots=True)
class _ProfilerMemory:
    """What the hook remembers between events."""

    backend: _Backend | None = None
    session: Any = None  # the profile object while a session is open
    began: bool = False  # TRAIN_BEGIN ran and the session of this run has not ended
    done: int = 0  # steps of this run completed
    exporting: bool = False  # whether a trace that becomes ready is written (False while aborting)
    init_step_open: bool = False  # start_on_init: ProfilerStep#1 began at TRAIN_BEGIN, step 1 is inside it
    metadata_recorded: bool = False
    open_range: Any = None  # the mstx range id of the step in progress


def _make_profiler_hook(config: ProfilerConfig, runtime: Runtime) -> Hook:
    setup = _Setup(
        config,
        runtime,
        device_type=_device_type(runtime.device),
        start=config.start_step,
        stop=config.stop_step,
        trace_dir=os.path.join(
            os.path.abspath(os.path.expanduser(config.output_path or "./output")),
            "profile",
            f"rank_{runtime.rank}",
        ),
        worker_name=f"rank_{runtime.rank}",
        distributed_args=json.dumps(_distributed_args(runtime)),
    )
    memory = _ProfilerMemory()
    start, stop = setup.start, setup.stop

    def profiler(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_BEGIN:
            if start <= memory.done + 1 <= stop:
                _step_begin(setup, memory, state)
        elif event is Event.STEP_END:
            memory.done += 1
            if start <= memory.done <= stop:
                _step_end(setup, memory)
        elif event is Event.TRAIN_BEGIN:
            _train_begin(setup, memory)
        elif event is Event.TRAIN_END:
            _finish(setup, memory, export=True)
        elif event is Event.ABORT:
            _abort(setup, memory, info)

    return profiler


def _on_trace_ready(setup: _Setup, memory: _ProfilerMemory, prof: Any, write: Callable[[Any], None]) -> None:
    if not memory.exporting:
        return
    try:
        write(prof)
    except Exception as error:  # noqa: BLE001 - a lost trace must not end the training run
        log.error("profiler: writing the trace to %s failed: %r", setup.trace_dir, error)
        return
    if setup.config.start_on_init and memory.done == 0:
        log.info("profiler: trace of the init phase written to %s", setup.trace_dir)
    else:
        log.info(
            "profiler: trace of %ssteps %d..%d written to %s",
            "the init phase and " if setup.config.start_on_init else "",
            setup.start, min(memory.done, setup.stop), setup.trace_dir,
        )  # fmt: skip


def _open_session(setup: _Setup, memory: _ProfilerMemory, *, init: bool = False) -> None:
    assert memory.backend is not None
    config, device_type, start, stop = setup.config, setup.device_type, setup.start, setup.stop
    profiler = memory.backend.profiler
    write = profiler.tensorboard_trace_handler(setup.trace_dir, worker_name=setup.worker_name)
    activities = [profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(profiler.ProfilerActivity.CUDA)
    elif device_type == "npu":
        activities.append(profiler.ProfilerActivity.NPU)
    with warnings.catch_warnings():
        # The window is exact by design (skip_first = start, active = stop - start + 1): no warmup.
        warnings.filterwarnings("ignore", message=".*warmup.*")
        schedule = profiler.schedule(wait=0, warmup=0, active=stop - start + 1, repeat=1, skip_first=start)
    kwargs: dict[str, Any] = dict(
        activities=activities,
        schedule=schedule,
        on_trace_ready=lambda prof: _on_trace_ready(setup, memory, prof, write),
        record_shapes=config.record_shapes,
        profile_memory=config.memory,
        with_stack=config.with_stack,
    )
    if device_type == "npu":
        kwargs["experimental_config"] = _npu_experimental_config(profiler, config)
    prof = profiler.profile(**kwargs)
    # The schedule counts profiler steps; the session opens just before step `start` of this run (or
    # at TRAIN_BEGIN with start_on_init), so its position is set to the step before: the next `step()`
    # is step `start`, recorded and marked ProfilerStep#<start>, and no profiler call is made on the
    # steps before the window. torch.profiler.profile and torch_npu's both keep it in `step_num`.
    prof.step_num = start - 1
    memory.session, memory.exporting = prof, True
    log.info(
        "profiler: rank %d records %ssteps %d..%d of this run into %s",
        setup.runtime.rank, "from TRAIN_BEGIN through " if init else "", start, stop, setup.trace_dir,
    )  # fmt: skip
    prof.start()
    if init:
        # start_on_init (start is 1): step into ProfilerStep#1 now, so that recording begins at
        # TRAIN_BEGIN and the init phase lands in the trace; step 1's STEP_BEGIN then does not step.
        memory.init_step_open = True
        prof.step()


def _record_metadata(setup: _Setup, memory: _ProfilerMemory) -> None:
    memory.metadata_recorded = True
    try:
        memory.session.add_metadata_json("distributed_args", setup.distributed_args)
    except Exception as error:  # noqa: BLE001 - metadata is a nicety, never a reason to fail
        log.warning("profiler: could not record the distributed_args metadata: %r", error)


def _end_range(memory: _ProfilerMemory) -> None:
    if memory.open_range is not None:
        range_id, memory.open_range = memory.open_range, None
        assert memory.backend is not None and memory.backend.mstx is not None
        memory.backend.mstx.range_end(range_id)


def _finish(setup: _Setup, memory: _ProfilerMemory, *, export: bool) -> None:
    """End the session once: write the window (or its recorded part) when `export`, else nothing."""
    memory.began = False
    prof, memory.session = memory.session, None
    if prof is None:
        return
    memory.exporting = export
    try:
        _end_range(memory)
    finally:
        try:
            if export and memory.done >= setup.stop:
                # The window's last step completed: close the cycle as the schedule does (this writes
                # the trace), so the stop below finds nothing left to do.
                prof.step()
            prof.stop()
        finally:
            memory.exporting = False


def _step_begin(setup: _Setup, memory: _ProfilerMemory, state: TrainState) -> None:
    if not memory.began:
        return
    if memory.session is None:
        _open_session(setup, memory)
    if memory.init_step_open:
        memory.init_step_open = False  # ProfilerStep#1 is already open since TRAIN_BEGIN
    else:
        memory.session.step()
    if not memory.metadata_recorded:
        _record_metadata(setup, memory)
    if setup.config.mstx:
        backend = memory.backend
        assert backend is not None and backend.mstx is not None
        # On the current NPU stream the range is also marked on the device timeline (None: host only).
        stream = None if backend.current_stream is None else backend.current_stream()
        memory.open_range = backend.mstx.range_start(f"step {state.global_step + 1}", stream)


def _step_end(setup: _Setup, memory: _ProfilerMemory) -> None:
    if memory.session is None:
        return
    _end_range(memory)
    if memory.done == setup.stop:
        _finish(setup, memory, export=True)


def _train_begin(setup: _Setup, memory: _ProfilerMemory) -> None:
    if memory.session is not None:  # a previous run on this hook neither ended nor aborted
        _finish(setup, memory, export=False)
    memory.done, memory.metadata_recorded, memory.open_range = 0, False, None
    memory.init_step_open = False
    memory.backend = _resolve_backend(setup.device_type)
    if setup.config.mstx and memory.backend.current_stream is None:
        log.warning(
            "profiler: this torch_npu has no npu.current_stream; mstx ranges are marked on the host only"
        )
    memory.began = True
    if setup.config.start_on_init:
        _open_session(setup, memory, init=True)


def _abort(setup: _Setup, memory: _ProfilerMemory, error: Any) -> None:
    try:
        _finish(setup, memory, export=False)
    except Exception as stop_error:  # noqa: BLE001 - ABORT must not hide the original error
        log.error("profiler: stopping the session after %r raised %r", error, stop_error)


# ----------------------------------------------------------------------------- backends


class _Backend(NamedTuple):
    """The profiler module (torch.profiler or torch_npu.profiler) and, on npu, torch_npu.npu.mstx and
    torch_npu.npu.current_stream (the stream mstx ranges are marked on)."""

    profiler: Any
    mstx: Any = None
    current_stream: Callable[[], Any] | None = None


def _resolve_backend(device_type: str) -> _Backend:
    """Import the profiler for `device_type`: torch_npu only for npu, and only here (never at import)."""
    if device_type == "npu":
        from fntrain.runtime.device import import_npu_module, import_torch_npu

        npu_profiler = import_npu_module("profiler")
        npu = getattr(import_torch_npu(), "npu", None)
        return _Backend(npu_profiler, getattr(npu, "mstx", None), getattr(npu, "current_stream", None))
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
    # The same rank -> coordinates arithmetic as the runtime mesh and the plan printout (pp outermost).
    return stage_leaders(world_size, stages)


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
