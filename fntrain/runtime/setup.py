"""`setup_runtime`: the process runtime from the torchrun environment, and its teardown (§5) [S2] [S3].

    with setup_runtime(RuntimeConfig(device="auto"), parallel=ParallelConfig(strategy="fsdp2")) as runtime:
        ...  # build, parallelize, train

Order inside: read the launcher's environment (`launch.py`) -> pick the device -> determinism and
precision flags (`seeding.py`, `threads.py`) -> set the device -> init the process group (backend +
timeout; `process_group.py`, `restart.py`) -> DeviceMesh (`mesh.py`) -> seed. On leaving the block
normally: device synchronize, barrier, destroy the process group (destroyed even when the barrier fails,
whose error is then re-raised; `teardown.py`). When the block raises, ranks are out of step, so no
barrier is attempted: the group is destroyed and the original exception propagates unchanged.
Global flags the runtime changed (determinism, TF32, torch's CPU threads) are restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.runtime import device as devices
from fntrain.runtime.launch import LaunchEnv, read_launch_env
from fntrain.runtime.mesh import build_mesh, coordinates, mesh_rank, parallel_sizes
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.process_group import BACKENDS, join_process_group, resolve_backend
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.seeding import seed_everything
from fntrain.runtime.teardown import (
    restore_global_flags,
    save_global_flags,
    teardown_after_error,
    teardown_runtime,
)
from fntrain.runtime.threads import choose_cpu_threads

__all__ = ["RuntimeConfig", "setup_runtime"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeConfig:
    """Process runtime settings."""

    device: Literal["cpu", "cuda", "npu", "auto"] = "cpu"
    """cpu, cuda, npu or auto (the best available: cuda, else npu when torch_npu is installed, else cpu)."""
    deterministic: bool = False
    """Full determinism: deterministic algorithms, cuBLAS workspace config, cuDNN deterministic and no benchmark, deterministic HCCL reductions on npu."""
    backend: str = "auto"
    """Process-group backend: auto (nccl on cuda, hccl on npu, gloo on cpu), gloo, nccl, hccl, or a per-device mapping such as 'cuda:nccl,cpu:gloo'."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds: a rank waiting longer than this for its peers fails."""
    tf32: bool = True
    """Allow TF32 (cuda) / HF32 (npu) for fp32 matmuls and convolutions: faster, ~10-bit mantissa."""
    cpu_threads: int = 0
    """torch CPU threads per process: 0 = automatic: OMP_NUM_THREADS when set, else the cores available to this process divided by the local ranks (torchrun's LOCAL_WORLD_SIZE)."""

    def validate(self, prefix: str = "runtime") -> None:
        require_choice(f"{prefix}.device", self.device, ("cpu", "cuda", "npu", "auto"))
        require_bool(f"{prefix}.deterministic", self.deterministic)
        require_str(f"{prefix}.backend", self.backend, non_empty=True)
        if ":" not in self.backend:
            require_choice(f"{prefix}.backend", self.backend, BACKENDS)
        require_float(f"{prefix}.timeout_s", self.timeout_s, min=0.0, min_exclusive=True)
        require_bool(f"{prefix}.tf32", self.tf32)
        require_int(f"{prefix}.cpu_threads", self.cpu_threads, min=0)


@contextlib.contextmanager
def setup_runtime(
    config: RuntimeConfig,
    parallel: ParallelConfig | None = None,
    *,
    seed: int = 42,
    env: Mapping[str, str] | None = None,
) -> Iterator[Runtime]:
    """Set up this process (see the module docstring) and yield its `Runtime`; tear down on exit.
    Python, numpy and torch are seeded with `seed` (42 when none is configured [S2]).

    Under torchrun (RANK/WORLD_SIZE set) a process group is initialised, even for one rank, and a
    DeviceMesh built; a plain `python` run gets no group (`runtime.distributed` is False). A process
    group that already exists is reused and left alone at exit. `parallel` supplies the strategy
    (recorded as `parallel_mode`) and the tp/pp/cp/ep degrees, which set dp_size = world / (tp*pp*cp).
    """
    config.validate("runtime")
    require_int("seed", seed, min=0)
    if parallel is not None:
        parallel.validate("parallel")
    launch = read_launch_env(env)
    sizes = parallel_sizes(parallel, launch.world_size)
    device_type = devices.resolve_device_type(config.device)
    backend = resolve_backend(config.backend, device_type)
    device = devices.local_device(device_type, launch.local_rank)

    flags = save_global_flags()
    precision_flags: dict[str, bool] = {}
    owns_group = False
    runtime = Runtime(device=device, seed=seed)
    try:
        precision_flags = _set_process_flags(config, device_type, seed, env)
        devices.set_device(device)
        owns_group = join_process_group(launch, backend, config.timeout_s, device)
        runtime = _make_runtime(config, parallel, launch, sizes, device, backend, owns_group, seed)
    except BaseException:
        teardown_after_error(runtime, owns_group, flags, device_type, precision_flags)
        raise

    try:
        yield runtime
    except BaseException:
        teardown_after_error(runtime, owns_group, flags, device_type, precision_flags)
        raise
    try:
        teardown_runtime(runtime, clean=True, owns_group=owns_group)
    finally:
        restore_global_flags(flags)
        devices.restore_precision_flags(device_type, precision_flags)


def _set_process_flags(
    config: RuntimeConfig, device_type: str, seed: int, env: Mapping[str, str] | None = None
) -> dict[str, bool]:
    """Determinism and seeds [S2] [S3], torch's CPU threads (`choose_cpu_threads`), then the precision flags; returns the precision flags' previous
    values (for `devices.restore_precision_flags`)."""
    if config.deterministic and device_type == "npu":
        os.environ.setdefault("HCCL_DETERMINISTIC", "true")  # read when HCCL initialises
    seed_everything(seed, config.deterministic)
    threads = choose_cpu_threads(config.cpu_threads, env)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return devices.set_precision_flags(device_type, config.tf32)


def _make_runtime(
    config: RuntimeConfig,
    parallel: ParallelConfig | None,
    launch: LaunchEnv,
    sizes: dict[str, int],
    device: torch.device,
    backend: str,
    owns_group: bool,
    seed: int,
) -> Runtime:
    """The `Runtime` record, with the DeviceMesh when a process group exists (whose size must be
    WORLD_SIZE); logged on the main rank."""
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != launch.world_size:
        raise RuntimeError(
            f"the existing process group has {dist.get_world_size()} ranks but WORLD_SIZE is {launch.world_size}"
        )
    replicate = parallel.replicate if parallel is not None else 1
    mesh = build_mesh(device.type, sizes, replicate) if distributed else None
    layout = coordinates(launch.rank, sizes)
    dp_rank = mesh.get_local_rank("dp") if mesh is not None else layout["dp"]
    from_mesh = {dim: mesh_rank(mesh, dim, layout[dim]) for dim in ("tp", "pp")} | {"dp": dp_rank}
    if from_mesh != layout:  # the plan printout and the profiler's stage leaders use the arithmetic
        raise RuntimeError(
            f"rank {launch.rank}: mesh coordinates {from_mesh} differ from the layout's {layout}"
        )
    runtime = Runtime(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        device=device,
        dp_size=sizes["dp_size"],
        tp_size=sizes["tp_size"],
        pp_size=sizes["pp_size"],
        cp_size=sizes["cp_size"],
        ep_size=sizes["ep_size"],
        dp_rank=dp_rank,
        tp_rank=from_mesh["tp"],
        pp_rank=from_mesh["pp"],
        cp_rank=mesh_rank(mesh, "cp", (launch.rank // sizes["tp_size"]) % sizes["cp_size"]),
        backend=(dist.get_backend() if not owns_group else backend) if distributed else None,
        mesh=mesh,
        seed=seed,
        parallel_mode=parallel.strategy if parallel is not None else "none",
        restart_count=launch.restart_count,
    )
    if runtime.is_main:
        log.info(
            "runtime: world %d, device %s, backend %s, dp %d (rank %d), tp %d, pp %d, cp %d, seed %d%s",
            runtime.world_size, device, runtime.backend, runtime.dp_size, runtime.dp_rank, runtime.tp_size,
            runtime.pp_size, runtime.cp_size, runtime.seed, ", deterministic" if config.deterministic else "",
        )  # fmt: skip
    return runtime
