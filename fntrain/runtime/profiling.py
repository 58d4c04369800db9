"""torch.profiler / torch_npu.profiler plumbing: the backend for a device and one traced window's session.

The profiler hook decides when and on which ranks; this module owns how. `resolve_backend` imports the
profiler for a device type (torch_npu only for npu, and only when called). A `TraceSession` is one
profiler over steps `start..stop` of a run: created just before step `start` (or at TRAIN_BEGIN with
`start_on_init`), with its schedule position set so that the profiler is never stepped before the window,
writing one trace when the window closes (cpu/cuda: Chrome traces through `tensorboard_trace_handler`;
npu: torch_npu's `*_ascend_pt` folders with its experimental config), recording the parallel layout once
as the `distributed_args` metadata, and on npu with mstx marking each step as a range on the NPU stream.
Logs go to the logger a session is given (the hook's), so a user's filter on that logger sees every line.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from fntrain.runtime.device import import_npu_module, import_torch_npu
from fntrain.runtime.runtime import Runtime

__all__ = [
    "ProfilerBackend",
    "check_device",
    "resolve_backend",
    "TraceSpec",
    "TraceSession",
    "device_type_of",
    "distributed_args",
]


_DEVICES = ("cpu", "cuda", "npu")


class ProfilerBackend(NamedTuple):
    """The profiler module (torch.profiler or torch_npu.profiler) and, on npu, torch_npu.npu.mstx and
    torch_npu.npu.current_stream (the stream mstx ranges are marked on)."""

    profiler: Any
    mstx: Any = None
    current_stream: Callable[[], Any] | None = None


def check_device(device: Any, *, mstx: bool, prefix: str) -> None:
    """Raise `RuntimeError` for a device without a profiler backend (cpu, cuda, npu have one) and
    `ValueError` for mstx off npu; `prefix` names the settings in the message. Imports nothing."""
    device_type = device_type_of(device)
    if device_type not in _DEVICES:
        raise RuntimeError(
            f"{prefix}: profiling needs a cpu, cuda or npu device (torch.profiler / torch_npu.profiler), "
            f"got {str(device)!r}"
        )
    if mstx and device_type != "npu":
        raise ValueError(f"{prefix}.mstx needs an npu device (mstx ranges are Ascend's), got {device_type!r}")


def resolve_backend(device_type: str) -> ProfilerBackend:
    """Import the profiler for `device_type`: torch_npu only for npu, and only here (never at import)."""
    if device_type == "npu":
        npu_profiler = import_npu_module("profiler")
        npu = getattr(import_torch_npu(), "npu", None)
        return ProfilerBackend(npu_profiler, getattr(npu, "mstx", None), getattr(npu, "current_stream", None))
    if device_type in ("cpu", "cuda"):
        return ProfilerBackend(importlib.import_module("torch.profiler"))
    raise RuntimeError(f"profiler: no profiler backend for device type {device_type!r}")


@dataclass(frozen=True)
class TraceSpec:
    """One rank's window, what it records and where its trace goes (from the hook's normalised config)."""

    device_type: str  # cpu, cuda or npu
    start: int  # first and last step of the window (steps of this run, 1-based, inclusive)
    stop: int
    start_on_init: bool  # the session opens at TRAIN_BEGIN (start is 1)
    trace_dir: str
    rank: int
    distributed_args: str  # JSON, recorded once per window
    record_shapes: bool
    profile_memory: bool
    with_stack: bool
    level: int  # npu profiler level 0, 1 or 2
    data_simplification: bool  # npu
    mstx: bool  # npu: each step an mstx range


class TraceSession:
    """One profiler over a window: `start` it, `begin_step` / `end_step` each step of the window, and
    `finish` it exactly once, writing the trace (or its recorded part) or, when aborting, nothing.

    Owns a resource (the started profiler), so it is a class with an explicit end (`finish`). Creating
    it creates the profiler object and starts nothing.
    """

    def __init__(self, backend: ProfilerBackend, spec: TraceSpec, log: logging.Logger) -> None:
        self.backend, self.spec, self._log = backend, spec, log
        self.done = 0  # steps of this run completed, as of `finish` (the trace's log line names them)
        self.exporting = True  # whether a trace that becomes ready is written (False while aborting)
        self.init_step_open = False  # start_on_init: ProfilerStep#1 began at TRAIN_BEGIN
        self.metadata_recorded = False
        self.open_range: Any = None  # the mstx range id of the step in progress
        self._profile = _new_profile(backend.profiler, spec, self._on_trace_ready)

    def start(self, *, init: bool = False) -> None:
        """Start recording: before step `start`, or with `init` at TRAIN_BEGIN (start is 1)."""
        spec = self.spec
        self._log.info(
            "profiler: rank %d records %ssteps %d..%d of this run into %s",
            spec.rank, "from TRAIN_BEGIN through " if init else "", spec.start, spec.stop, spec.trace_dir,
        )  # fmt: skip
        self._profile.start()
        if init:
            # Step into ProfilerStep#1 now, so that recording begins at TRAIN_BEGIN and the init phase
            # lands in the trace; step 1's `begin_step` then does not step.
            self.init_step_open = True
            self._profile.step()

    def begin_step(self, step: int) -> None:
        """Step `step` (global) begins: the profiler steps, the metadata is recorded once, mstx opens."""
        if self.init_step_open:
            self.init_step_open = False  # ProfilerStep#1 is already open since TRAIN_BEGIN
        else:
            self._profile.step()
        if not self.metadata_recorded:
            self._record_metadata()
        if self.spec.mstx:
            backend = self.backend
            assert backend.mstx is not None
            # On the current NPU stream the range is also marked on the device timeline (None: host only).
            stream = None if backend.current_stream is None else backend.current_stream()
            self.open_range = backend.mstx.range_start(f"step {step}", stream)

    def end_step(self) -> None:
        """The step in progress ended: close its mstx range."""
        if self.open_range is not None:
            range_id, self.open_range = self.open_range, None
            assert self.backend.mstx is not None
            self.backend.mstx.range_end(range_id)

    def finish(self, *, export: bool, done: int) -> None:
        """End the session after `done` steps of this run: write the window (or its recorded part) when
        `export`, else nothing. Call once."""
        self.exporting, self.done = export, done
        try:
            self.end_step()
        finally:
            try:
                if export and done >= self.spec.stop:
                    # The window's last step completed: close the cycle as the schedule does (this
                    # writes the trace), so the stop below finds nothing left to do.
                    self._profile.step()
                self._profile.stop()
            finally:
                self.exporting = False

    def _record_metadata(self) -> None:
        self.metadata_recorded = True
        try:
            self._profile.add_metadata_json("distributed_args", self.spec.distributed_args)
        except Exception as error:  # noqa: BLE001 - metadata is a nicety, never a reason to fail
            self._log.warning("profiler: could not record the distributed_args metadata: %r", error)

    def _on_trace_ready(self, profile: Any, write: Callable[[Any], None]) -> None:
        if not self.exporting:
            return
        spec = self.spec
        try:
            write(profile)
        except Exception as error:  # noqa: BLE001 - a lost trace must not end the training run
            self._log.error("profiler: writing the trace to %s failed: %r", spec.trace_dir, error)
            return
        if spec.start_on_init and self.done == 0:
            self._log.info("profiler: trace of the init phase written to %s", spec.trace_dir)
        else:
            self._log.info(
                "profiler: trace of %ssteps %d..%d written to %s",
                "the init phase and " if spec.start_on_init else "",
                spec.start, min(self.done, spec.stop), spec.trace_dir,
            )  # fmt: skip


def _new_profile(profiler: Any, spec: TraceSpec, on_trace_ready: Callable[[Any, Any], None]) -> Any:
    """The profile object for the window, positioned just before step `start`; not started."""
    write = profiler.tensorboard_trace_handler(spec.trace_dir, worker_name=f"rank_{spec.rank}")
    activities = [profiler.ProfilerActivity.CPU]
    if spec.device_type == "cuda":
        activities.append(profiler.ProfilerActivity.CUDA)
    elif spec.device_type == "npu":
        activities.append(profiler.ProfilerActivity.NPU)
    with warnings.catch_warnings():
        # The window is exact by design (skip_first = start, active = stop - start + 1): no warmup.
        warnings.filterwarnings("ignore", message=".*warmup.*")
        active = spec.stop - spec.start + 1
        schedule = profiler.schedule(wait=0, warmup=0, active=active, repeat=1, skip_first=spec.start)
    kwargs: dict[str, Any] = dict(
        activities=activities,
        schedule=schedule,
        on_trace_ready=lambda profile: on_trace_ready(profile, write),
        record_shapes=spec.record_shapes,
        profile_memory=spec.profile_memory,
        with_stack=spec.with_stack,
    )
    if spec.device_type == "npu":
        kwargs["experimental_config"] = _npu_experimental_config(profiler, spec)
    profile = profiler.profile(**kwargs)
    # The schedule counts profiler steps; the session opens just before step `start` of this run (or
    # at TRAIN_BEGIN with start_on_init), so its position is set to the step before: the next `step()`
    # is step `start`, recorded and marked ProfilerStep#<start>, and no profiler call is made on the
    # steps before the window. torch.profiler.profile and torch_npu's both keep it in `step_num`.
    profile.step_num = spec.start - 1
    return profile


def _npu_experimental_config(npu_profiler: Any, spec: TraceSpec) -> Any:
    """torch_npu's experimental config: level, data simplification, mstx, text export."""
    make = npu_profiler._ExperimentalConfig
    kwargs: dict[str, Any] = dict(
        profiler_level=getattr(npu_profiler.ProfilerLevel, f"Level{spec.level}"),
        data_simplification=spec.data_simplification,
        export_type=npu_profiler.ExportType.Text,
    )
    # torch_npu >= 2.1.0.post10 calls the switch `mstx`; older releases `msprof_tx`.
    try:
        params = inspect.signature(make).parameters
    except (TypeError, ValueError):
        params = {}
    if "mstx" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs["mstx"] = spec.mstx
    elif "msprof_tx" in params:
        kwargs["msprof_tx"] = spec.mstx
    else:
        kwargs["mstx"] = spec.mstx
    return make(**kwargs)


def distributed_args(runtime: Runtime) -> dict[str, Any]:
    """The parallel layout as cluster analysis tools read it from a trace's `distributed_args`."""
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


def device_type_of(device: Any) -> str:
    """`device`'s type: a torch.device's `type`, or the part of a string before ':' ("npu:0" -> npu)."""
    device_type = getattr(device, "type", None)
    return device_type if isinstance(device_type, str) else str(device).split(":", 1)[0]
