"""Capture and restore this process's RNG states as JSON (python, numpy, torch CPU, the device) [S36].

Each rank saves its own states and restores its own: restoring rank 0's RNG everywhere would make the
ranks draw identical dropout masks after a resume. Byte states are base64 text, so the file is plain
JSON and loading it executes nothing.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _device_module(device: torch.device) -> Any:
    """torch.cuda / torch.npu (present once torch_npu was imported by the runtime) / None for cpu."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_rng_state"):
        raise RuntimeError(
            f"no RNG state API for device type {device.type!r} (torch.{device.type}.get_rng_state)"
        )
    return module


def rng_state(device: torch.device | str = "cpu") -> dict[str, Any]:
    """A JSON-able snapshot of the python, numpy, torch CPU and (non-CPU) device generators."""
    device = torch.device(device)
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": _encode(torch.get_rng_state()),
    }
    module = _device_module(device)
    if module is not None:
        index = device.index if device.index is not None else module.current_device()
        state["device"] = {"type": device.type, "state": _encode(module.get_rng_state(index))}
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | str = "cpu") -> None:
    """Restore a `rng_state` snapshot; the device state only onto a device of the same type."""
    device = torch.device(device)
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            np.asarray(numpy["keys"], dtype=np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(_decode(state["torch_cpu"]))
    saved_device = state.get("device")
    module = _device_module(device)
    if saved_device is not None and module is not None and saved_device["type"] == device.type:
        index = device.index if device.index is not None else module.current_device()
        module.set_rng_state(_decode(saved_device["state"]), index)
