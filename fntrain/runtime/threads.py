"""`choose_cpu_threads`: how many CPU threads torch uses in this process, so that the ranks of one
machine share its cores instead of over-subscribing them."""

from __future__ import annotations

import os
from collections.abc import Mapping

from fntrain.runtime.launch import env_int

__all__ = ["choose_cpu_threads"]


def _available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota when one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as handle:
            quota, period = handle.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def choose_cpu_threads(
    cpu_threads: int, env: Mapping[str, str] | None = None, available_cores: int | None = None
) -> int:
    """torch's CPU threads for this process: `cpu_threads` when positive; else OMP_NUM_THREADS when set,
    else the available cores divided by the local ranks (LOCAL_WORLD_SIZE), at least 1.

    This keeps ranks on one machine from over-subscribing its cores. Other processes on the same cores
    still make torch's OpenMP threads spin at their barriers (10x slower steps on 2 shared cores);
    OMP_WAIT_POLICY=passive, set before torch is imported, removes that (bench/RESULTS.md, Contention).
    """
    if cpu_threads > 0:
        return cpu_threads
    env = os.environ if env is None else env
    from_env = env_int(env, "OMP_NUM_THREADS", 0)
    if from_env > 0:
        return from_env
    cores = _available_cores() if available_cores is None else available_cores
    return max(1, cores // max(1, env_int(env, "LOCAL_WORLD_SIZE", 1)))
