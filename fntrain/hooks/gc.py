"""GC [S33]: Python garbage collection and the device cache on a fixed step cadence.

Collecting on the same steps on every rank, with automatic collection turned off, keeps a collection
pause on one rank from stalling the others at the next collective (stragglers). `gc.collect()` runs every
`gc_every` steps; the device's caching allocator is emptied every `empty_cache_every` steps (not on cpu,
which has no such cache). With `disable_automatic`, automatic collection is off from TRAIN_BEGIN and
turned back on at TRAIN_END or ABORT (only if this hook turned it off).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.config import require_bool, require_int
from fntrain.hooks.base import chain, every, on
from fntrain.loop import Event, Hook
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["GCConfig", "gc_hook"]

log = logging.getLogger("fntrain.hooks.gc")


@dataclass(frozen=True)
class GCConfig:
    """Garbage collection and device-cache cadence."""

    gc_every: int = 0
    """Run gc.collect() every N optimizer steps (0: never)."""
    generation: int = 2
    """Oldest generation gc.collect() collects (0, 1 or 2)."""
    empty_cache_every: int = 0
    """Empty the device's caching allocator every N steps (0: never; ignored on cpu)."""
    disable_automatic: bool = False
    """Turn Python's automatic gc off during training (set gc_every so garbage is still collected)."""

    def validate(self, prefix: str = "gc") -> None:
        require_int(f"{prefix}.gc_every", self.gc_every, min=0)
        require_int(f"{prefix}.generation", self.generation, min=0, max=2)
        require_int(f"{prefix}.empty_cache_every", self.empty_cache_every, min=0)
        require_bool(f"{prefix}.disable_automatic", self.disable_automatic)


def _empty_cache_fn(device: torch.device) -> Any:
    """The device module's empty_cache (torch.cuda / torch.npu ...), None on cpu."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device).empty_cache


@dataclass(slots=True)
class _GCMemory:
    """What the GC hook remembers between events."""

    empty_cache: Any = None  # the device module's empty_cache, looked up at TRAIN_BEGIN
    disabled_by_us: bool = False  # this hook turned automatic gc off (and so turns it back on)


def _restore(memory: _GCMemory) -> None:
    """Turn automatic gc back on, only if this hook turned it off."""
    if memory.disabled_by_us:
        memory.disabled_by_us = False
        gc.enable()


def gc_hook(config: GCConfig, runtime: Runtime) -> Hook:
    """The GC hook for `runtime` (every rank: the point is that ranks collect on the same steps)."""
    config.validate()
    if config.disable_automatic and not config.gc_every:
        log.warning(
            "gc.disable_automatic without gc.gc_every: cyclic garbage is not collected during training"
        )
    collect_every, generation = config.gc_every, config.generation
    cache_every = config.empty_cache_every if runtime.device.type != "cpu" else 0
    if config.empty_cache_every and not cache_every:
        log.info("gc.empty_cache_every is ignored on cpu (no caching allocator)")
    memory = _GCMemory()

    def automatic(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.TRAIN_BEGIN:
            if cache_every:
                memory.empty_cache = _empty_cache_fn(runtime.device)
            if config.disable_automatic and gc.isenabled():
                gc.disable()
                memory.disabled_by_us = True
        elif event is Event.TRAIN_END or event is Event.ABORT:
            _restore(memory)

    parts: list[Hook] = [automatic]
    if collect_every:
        parts.append(every(collect_every, on(Event.STEP_END, lambda state, info: gc.collect(generation))))
    if cache_every:
        parts.append(every(cache_every, on(Event.STEP_END, lambda state, info: memory.empty_cache())))
    return chain(*parts)
