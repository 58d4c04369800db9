"""The device's caching allocator as one seam: which module a device uses, what it offers, its OOM observer.

An allocator is a module-like object with torch.cuda.memory's private API (`_record_memory_history`,
`_snapshot`, `max_memory_reserved`, ...): `torch.cuda.memory` on cuda, `torch_npu.npu.memory` on npu
(torch_npu imported only then, through `fntrain.runtime.device`), none on other devices. Tests stand in
for a device by passing an object with the same names. Nothing here touches a device.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "HISTORY_API",
    "SNAPSHOT_API",
    "STATS_API",
    "is_out_of_memory",
    "default_allocator",
    "require_api",
    "oom_attacher",
    "OomSlot",
    "oom_slot",
]

HISTORY_API = ("_record_memory_history",)
SNAPSHOT_API = ("_snapshot", "_dump_snapshot")  # either; `_snapshot` preferred (see memory_history)
STATS_API = (
    "max_memory_reserved",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "memory_allocated",
    "memory_reserved",
)


def is_out_of_memory(error: BaseException | None) -> bool:
    """True for a device out-of-memory error: torch.OutOfMemoryError (cuda), NPU's equivalent by class
    name, or an older backend's RuntimeError whose message says "out of memory"."""
    if error is None:
        return False
    if any("OutOfMemory" in cls.__name__ for cls in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def default_allocator(device_type: str) -> Any:
    """The backend's memory module for the device type: cuda, npu; None for devices without one."""
    if device_type == "cuda":
        return importlib.import_module("torch.cuda.memory")
    if device_type == "npu":
        from fntrain.runtime.device import import_torch_npu

        try:
            torch_npu = import_torch_npu()  # only ever for an npu device
        except RuntimeError as error:
            raise RuntimeError(
                f"memory hook: device 'npu' needs torch_npu, which failed to import: {error}"
            ) from error
        module = getattr(getattr(torch_npu, "npu", None), "memory", None)
        if module is None:
            raise RuntimeError("memory hook: this torch_npu has no torch_npu.npu.memory module")
        return module
    return None


def require_api(
    allocator: Any, device_type: str, names: tuple[str, ...], *, any_of: tuple[str, ...] = ()
) -> None:
    """Raise `RuntimeError` naming what `allocator` lacks of `names` (all) and `any_of` (one of them)."""
    missing = [name for name in names if not callable(getattr(allocator, name, None))]
    if any_of and not any(callable(getattr(allocator, name, None)) for name in any_of):
        missing.append(" or ".join(any_of))
    if missing:
        owner = getattr(allocator, "__name__", type(allocator).__name__)
        raise RuntimeError(
            f"memory hook: the {device_type} allocator ({owner}) lacks {', '.join(missing)}; "
            "this torch build cannot record or report allocator memory"
        )


def oom_attacher(allocator: Any) -> Callable[[Callable[..., None]], None] | None:
    """How to attach an OOM observer to `allocator`'s backend, or None where it has no observer API.

    A stand-in allocator may offer `attach_out_of_memory_observer`; the real backends keep theirs in
    their C extension (`torch._C._cuda_attach_out_of_memory_observer`,
    `torch_npu._C._npu_attach_out_of_memory_observer`).
    """
    attach = getattr(allocator, "attach_out_of_memory_observer", None)
    if attach is not None:
        return attach
    name = getattr(allocator, "__name__", "")
    if name.startswith("torch.cuda"):
        import torch

        return getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if name.startswith(("torch_npu", "torch.npu")):
        torch_npu = sys.modules.get("torch_npu")  # imported by default_allocator for npu
        return getattr(getattr(torch_npu, "_C", None), "_npu_attach_out_of_memory_observer", None)
    return None


class OomSlot:
    """The observer attached once per allocator backend (an attachment cannot be undone); it forwards
    to its `target` (the window recording now), if any."""

    def __init__(self) -> None:
        self.target: Callable[..., None] | None = None

    def __call__(self, *payload: Any) -> None:
        target = self.target
        if target is not None:
            target(*payload)


_OOM_SLOTS: dict[Any, OomSlot] = {}
_OOM_SLOTS_LOCK = threading.Lock()


def oom_slot(attach: Callable[[Callable[..., None]], None]) -> OomSlot:
    """The backend's one `OomSlot`, attached with `attach` the first time it is asked for."""
    with _OOM_SLOTS_LOCK:
        slot = _OOM_SLOTS.get(attach)
        if slot is None:
            slot = OomSlot()
            attach(slot)
            _OOM_SLOTS[attach] = slot
        return slot
