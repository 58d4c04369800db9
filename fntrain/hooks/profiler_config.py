"""The profiler hook's settings [S34]: `ProfilerConfig`, its rules and which ranks profile.

`ProfilerConfig.validate` holds the type rules and needs no runtime; `check_profiler_config(config,
runtime)` adds the rules that need the launch (rank range, pipeline stages, device) and returns the
config normalised (steps < 1, `start_on_init` with a later start and bad levels replaced, with a
`UserWarning`). Neither touches a device or imports a profiler: the run's first phase calls them before
any model or device work. `profiled_ranks` says which global ranks trace. The hook itself
(`fntrain.hooks.profiler`, which re-exports these names) decides when.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from fntrain.config import ConfigError, require_bool, require_int, require_str
from fntrain.mesh_layout import stage_leaders
from fntrain.runtime import profiling
from fntrain.runtime.runtime import Runtime

__all__ = ["ProfilerConfig", "check_profiler_config", "profiled_ranks"]

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
