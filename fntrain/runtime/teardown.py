"""The runtime's end: synchronize, barrier and destroy the process group, and put back the global flags
the setup changed (determinism, cuDNN, torch's CPU threads, the environment variables it set)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from fntrain.runtime import device as devices
from fntrain.runtime.process_group import leave_process_group
from fntrain.runtime.runtime import Runtime

__all__ = ["teardown_runtime", "teardown_after_error", "save_global_flags", "restore_global_flags"]

# The setup's logger, as before the split: its records keep their logger name.
log = logging.getLogger("fntrain.runtime.setup")


def save_global_flags() -> dict[str, Any]:
    """The process-wide flags `setup_runtime` may change, to put back with `restore_global_flags`."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cpu_threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC")},
    }


def restore_global_flags(flags: dict[str, Any]) -> None:
    """Put back what `save_global_flags` returned."""
    current = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if current != (flags["deterministic"], flags["warn_only"]):  # the setter imports inductor: seconds
        torch.use_deterministic_algorithms(flags["deterministic"], warn_only=flags["warn_only"])
    torch.backends.cudnn.deterministic = flags["cudnn.deterministic"]
    torch.backends.cudnn.benchmark = flags["cudnn.benchmark"]
    if torch.get_num_threads() != flags["cpu_threads"]:
        torch.set_num_threads(flags["cpu_threads"])
    for name, value in flags["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def teardown_runtime(runtime: Runtime, *, clean: bool = True, owns_group: bool = True) -> None:
    """End the runtime: device synchronize and barrier (when `clean`), then destroy the process group
    when this runtime created it, even if the synchronize or the barrier failed (that error is
    re-raised after the group is gone)."""
    try:
        if clean:
            devices.synchronize(runtime.device)
            if owns_group and dist.is_available() and dist.is_initialized():
                dist.barrier()
    finally:
        leave_process_group(owns_group)


def teardown_after_error(
    runtime: Runtime,
    owns_group: bool,
    flags: dict[str, Any],
    device_type: str,
    precision_flags: dict[str, bool],
) -> None:
    """Teardown on the failure path: no synchronize or barrier (peers may be stuck elsewhere); a
    teardown error is logged, never allowed to replace the exception being raised."""
    try:
        teardown_runtime(runtime, clean=False, owns_group=owns_group)
    except Exception:
        log.exception("runtime teardown failed while handling another error")
    finally:
        restore_global_flags(flags)
        try:
            devices.restore_precision_flags(device_type, precision_flags)
        except Exception:
            log.exception("restoring precision flags failed while handling another error")
