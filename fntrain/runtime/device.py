"""Devices: cpu, cuda and npu behind one small set of functions (§5).

This is the only module that imports `torch_npu`, and only inside `import_torch_npu()`: installing
torch_npu on a machine without Ascend's CANN breaks `import torch` itself, so nothing may import it
unless the run asked for an NPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "DEVICE_TYPES",
    "DEFAULT_BACKENDS",
    "import_torch_npu",
    "import_npu_module",
    "npu_installed",
    "resolve_device_type",
    "device_module",
    "device_count",
    "local_device",
    "set_device",
    "synchronize",
    "default_backend",
    "set_precision_flags",
]

DEVICE_TYPES = ("cpu", "cuda", "npu")
DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def import_torch_npu() -> ModuleType:
    """Import `torch_npu` (which registers `torch.npu` and the hccl backend) or fail with an install hint."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as error:
        raise RuntimeError(
            "device 'npu' needs torch_npu (Ascend's PyTorch adapter, matching your torch and CANN "
            "versions): pip install torch_npu; see docs/distributed.md"
        ) from error


def import_npu_module(name: str) -> ModuleType:
    """`torch_npu.<name>` (e.g. "profiler"), importing torch_npu first: hooks reach torch_npu only here."""
    import_torch_npu()
    return importlib.import_module(f"torch_npu.{name}")


def npu_installed() -> bool:
    """True when torch_npu can be imported, found without importing it."""
    if "torch_npu" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def resolve_device_type(name: str) -> str:
    """`cpu` | `cuda` | `npu` as given (checked to be usable), or for `auto` the best available.

    auto: cuda when a GPU is visible, else npu when torch_npu is installed and sees an NPU, else cpu.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if npu_installed():
            import_torch_npu()
            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu"
        return "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("runtime.device is 'cuda' but torch.cuda.is_available() is False")
        return "cuda"
    if name == "npu":
        import_torch_npu()
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise RuntimeError("runtime.device is 'npu' but torch_npu reports no available NPU")
        return "npu"
    raise ValueError(f"runtime.device must be one of ['auto', 'cpu', 'cuda', 'npu'], got {name!r}")


def device_module(device_type: str) -> Any:
    """`torch.cuda` / `torch.npu` (None for cpu): the per-device API (set_device, synchronize, ...)."""
    if device_type == "cpu":
        return None
    if device_type == "npu":
        import_torch_npu()
    return getattr(torch, device_type)


def device_count(device_type: str) -> int:
    module = device_module(device_type)
    return 1 if module is None else int(module.device_count())


def local_device(device_type: str, local_rank: int) -> torch.device:
    """This process's device: `cpu`, or `cuda:<local_rank>` / `npu:<local_rank>` (checked to exist)."""
    if device_type == "cpu":
        return torch.device("cpu")
    count = device_count(device_type)
    if not 0 <= local_rank < count:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} has no {device_type} device: this node sees {count}; "
            f"launch at most {count} processes per node (torchrun --nproc_per_node)"
        )
    return torch.device(device_type, local_rank)


def set_device(device: torch.device) -> None:
    """Make `device` the current device of this process (no-op on cpu)."""
    module = device_module(device.type)
    if module is not None:
        module.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on cpu); called at teardown and to time a rollout's phases
    (once per generation batch, where the sampler reads the device anyway), never per plain step."""
    module = device_module(device.type)
    if module is not None:
        module.synchronize(device)


def default_backend(device_type: str) -> str:
    """nccl (cuda), hccl (npu), gloo (cpu)."""
    return DEFAULT_BACKENDS[device_type]


def set_precision_flags(device_type: str, tf32: bool) -> dict[str, bool]:
    """Allow (or forbid) reduced-precision fp32 matmuls/convolutions: TF32 on cuda, HF32 on npu.

    Returns the previous values, keyed by flag, so the runtime can restore them at teardown.
    """
    previous: dict[str, bool] = {}
    if device_type == "cuda":
        previous["cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        previous["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    elif device_type == "npu":
        npu = device_module("npu")
        previous["npu.matmul.allow_hf32"] = bool(npu.matmul.allow_hf32)
        previous["npu.conv.allow_hf32"] = bool(npu.conv.allow_hf32)
        npu.matmul.allow_hf32 = tf32
        npu.conv.allow_hf32 = tf32
    return previous


def restore_precision_flags(device_type: str, previous: dict[str, bool]) -> None:
    """Undo `set_precision_flags` with the values it returned."""
    if not previous:
        return
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = previous["cuda.matmul.allow_tf32"]
        torch.backends.cudnn.allow_tf32 = previous["cudnn.allow_tf32"]
    elif device_type == "npu":
        npu = device_module("npu")
        npu.matmul.allow_hf32 = previous["npu.matmul.allow_hf32"]
        npu.conv.allow_hf32 = previous["npu.conv.allow_hf32"]
