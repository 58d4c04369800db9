"""The process group: its backend, joining it from torchrun's env:// rendezvous, and leaving it."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from fntrain.runtime import device as devices
from fntrain.runtime.launch import LaunchEnv
from fntrain.runtime.restart import attempt_store, note_restart_hint

__all__ = ["BACKENDS", "resolve_backend", "init_process_group", "join_process_group", "leave_process_group"]

BACKENDS = ("auto", "gloo", "nccl", "hccl")
_BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu"}

# The store client `init_process_group` made, released right after the process group is destroyed:
# left to interpreter shutdown, its destruction can abort the process ("terminate called without an
# active exception") after an otherwise clean run.
_ATTEMPT_STORE: list[Any] = []


def resolve_backend(backend: str, device_type: str) -> str:
    """The process-group backend for `device_type`: auto -> nccl (cuda), hccl (npu), gloo (cpu);
    an explicit nccl/hccl must match the device; a 'dev:backend,...' mapping is passed through."""
    if backend == "auto":
        return devices.default_backend(device_type)
    if ":" in backend:
        return backend
    required = _BACKEND_DEVICE.get(backend)
    if required is not None and required != device_type:
        raise ValueError(f"runtime.backend {backend!r} needs device {required!r}, got device {device_type!r}")
    return backend


def init_process_group(backend: str, timeout_s: float, device: torch.device, launch: LaunchEnv) -> None:
    """`dist.init_process_group` from the env:// rendezvous torchrun provides, on one node through the
    agent's store scoped by the restart count (`fntrain.runtime.restart`); a seam for tests."""
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL communicator init bound to this rank's GPU
    timeout = datetime.timedelta(seconds=timeout_s)
    store = attempt_store(timeout, launch.restart_count)
    _ATTEMPT_STORE[:] = [store] if store is not None else []
    if store is not None:
        kwargs.update(store=store, rank=launch.rank, world_size=launch.world_size)
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


def join_process_group(launch: LaunchEnv, backend: str, timeout_s: float, device: torch.device) -> bool:
    """Initialise the process group of a launched process unless one exists; True when this call made it
    (then this runtime owns it and destroys it at exit)."""
    already = dist.is_available() and dist.is_initialized()
    if not launch.launched or already:
        return False
    try:
        init_process_group(backend, timeout_s, device, launch)
    except Exception as error:
        note_restart_hint(error, launch.restart_count)
        raise
    return True


def leave_process_group(owns_group: bool) -> None:
    """Destroy the process group when this runtime made it, then release the attempt store."""
    if owns_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _ATTEMPT_STORE.clear()
