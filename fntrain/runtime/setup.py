"""`setup_runtime`: the process runtime from the torchrun environment, and its teardown (§5) [S2] [S3].

    with setup_runtime(RuntimeConfig(device="auto"), parallel=ParallelConfig(strategy="fsdp2")) as runtime:
        ...  # build, parallelize, train

Order inside: read the launcher's environment -> pick the device -> determinism and precision flags ->
set the device -> init the process group (backend + timeout) -> DeviceMesh -> seed. On leaving the
block normally: device synchronize, barrier, destroy the process group (destroyed even when the
barrier fails, whose error is then re-raised). When the block raises, ranks are out of step, so no
barrier is attempted: the group is destroyed and the original exception propagates unchanged.
Global flags the runtime changed (determinism, TF32, torch's CPU threads) are restored on exit.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.runtime import device as devices
from fntrain.runtime.expert_parallel import EP_DIMS
from fntrain.runtime.parallel import DP_CP, HSDP_DIMS, ParallelConfig, hsdp_shape
from fntrain.runtime.runtime import Runtime

__all__ = [
    "RuntimeConfig",
    "LaunchEnv",
    "read_launch_env",
    "resolve_backend",
    "setup_runtime",
    "teardown_runtime",
    "seed_everything",
    "choose_cpu_threads",
]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl", "hccl")
_BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu"}


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


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun) told this process; `launched` is False for a plain `python` run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE as torchrun sets them (validated).

    A process is `launched` when RANK and WORLD_SIZE are both set; then MASTER_ADDR and MASTER_PORT
    must be set too (torchrun does; other launchers must).
    """
    env = os.environ if env is None else env
    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if has_rank != has_world:
        missing = "WORLD_SIZE" if has_rank else "RANK"
        raise ValueError(
            f"environment variable {missing} is not set but {'RANK' if has_rank else 'WORLD_SIZE'} is"
        )
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", world_size)
    if local_world_size < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
    local_rank = _env_int(env, "LOCAL_RANK", rank % local_world_size)
    if world_size < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"environment variable RANK must be in [0, {world_size}), got {rank}")
    if local_rank < 0:
        raise ValueError(f"environment variable LOCAL_RANK must be >= 0, got {local_rank}")
    if has_rank:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise ValueError(
                f"RANK/WORLD_SIZE are set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                "launch with torchrun, or set the rendezvous address yourself"
            )
    return LaunchEnv(rank, local_rank, world_size, local_world_size, launched=has_rank)


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


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (every device) with `seed` [S2]; `deterministic` turns on [S3]."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


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
    from_env = _env_int(env, "OMP_NUM_THREADS", 0)
    if from_env > 0:
        return from_env
    cores = _available_cores() if available_cores is None else available_cores
    return max(1, cores // max(1, _env_int(env, "LOCAL_WORLD_SIZE", 1)))


def _global_flags() -> dict[str, Any]:
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cpu_threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC")},
    }


def _restore_global_flags(flags: dict[str, Any]) -> None:
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


def _init_process_group(backend: str, timeout_s: float, device: torch.device) -> None:
    """`dist.init_process_group` from the env:// rendezvous torchrun provides (a seam for tests)."""
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL communicator init bound to this rank's GPU
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _attempt_store(timeout)
    _ATTEMPT_STORE[:] = [store] if store is not None else []
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


# The store client `_init_process_group` made, released right after the process group is destroyed:
# left to interpreter shutdown, its destruction can abort the process ("terminate called without an
# active exception") after an otherwise clean run.
_ATTEMPT_STORE: list[Any] = []


def _attempt_store(timeout: datetime.timedelta, env: Mapping[str, str] | None = None) -> Any:
    """On one node under torchrun's shared agent store, a client of that store whose keys are scoped by
    the restart count; else None (the env:// rendezvous as usual).

    torchrun (torch >= 2.4) keeps one TCPStore for all attempts of a job and no longer scopes the
    workers' keys by attempt, so a restarted worker can read its dead predecessors' addresses and fail
    to form the process group (pytorch/pytorch#135712). With a single agent, TORCHELASTIC_RESTART_COUNT
    is the same for every worker and scopes them safely; across nodes the agents count restarts
    independently, so there the store is left alone (see RESTART_HINT).
    """
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world, local_world = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    if not world or world != local_world:
        return None
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(world), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"fntrain/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


RESTART_HINT = (
    "this process was restarted by torchrun, which shares one rendezvous store between attempts and "
    "keeps the previous attempt's keys (pytorch/pytorch#135712); across several nodes, run torchrun "
    "with --rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
)


def _note_restart_hint(error: BaseException, env: Mapping[str, str] | None = None) -> None:
    """Add `RESTART_HINT` to a failed process-group init of a restarted worker that uses the agent's
    store (the exception keeps its type)."""
    env = os.environ if env is None else env
    restarted = env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    several_nodes = env.get("WORLD_SIZE") != env.get("LOCAL_WORLD_SIZE")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restarted and agent_store and several_nodes and hasattr(error, "add_note"):
        error.add_note(RESTART_HINT)
        log.error("process-group init failed after a restart: %s", RESTART_HINT)


def _parallel_sizes(parallel: ParallelConfig | None, world_size: int) -> dict[str, int]:
    sizes = {
        name: getattr(parallel, name) if parallel else 1
        for name in ("tp_size", "pp_size", "cp_size", "ep_size")
    }
    model_parallel = sizes["tp_size"] * sizes["pp_size"] * sizes["cp_size"]
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} must be divisible by parallel.tp_size x pp_size x cp_size "
            f"= {sizes['tp_size']} x {sizes['pp_size']} x {sizes['cp_size']} = {model_parallel}"
        )
    sizes["dp_size"] = world_size // model_parallel
    if sizes["dp_size"] % sizes["ep_size"]:  # experts are sharded over part of the data-parallel ranks
        raise ValueError(
            f"parallel.ep_size ({sizes['ep_size']}) must divide the data-parallel size ({sizes['dp_size']})"
        )
    hsdp_shape(sizes["dp_size"], getattr(parallel, "replicate", 1) if parallel else 1)  # R must divide dp
    return sizes


def _build_mesh(device_type: str, sizes: dict[str, int], replicate: int = 1) -> Any:
    """A DeviceMesh over ("pp", "dp", "cp", "tp"), keeping "dp" and every dimension larger than 1.
    Under HSDP (parallel.replicate > 1) "dp" is laid out as ("dp_replicate", "dp_shard") and
    flattened back into "dp", so `mesh["dp"]` is the whole data-parallel group either way."""
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = replicate > 1
    expert_parallel = sizes.get("ep_size", 1) > 1  # ("dp_mod_ep", "ep") flattened into "dp" likewise
    data_dims = HSDP_DIMS if hsdp else EP_DIMS if expert_parallel else ("dp",)
    sizes = dict(sizes)
    sizes["dp_replicate_size"], sizes["dp_shard_size"] = hsdp_shape(sizes["dp_size"], replicate)
    sizes["dp_mod_ep_size"] = sizes["dp_size"] // sizes.get("ep_size", 1)
    names = ("pp", *data_dims, "cp", "tp")
    dims = [(name, sizes[f"{name}_size"]) for name in names]
    dims = [(name, size) for name, size in dims if name in data_dims or size > 1]
    mesh = init_device_mesh(
        device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims)
    )
    if hsdp or expert_parallel:
        mesh[data_dims]._flatten("dp")
    if sizes["cp_size"] > 1:  # gradients reduce over dp x cp (fntrain.runtime.parallel.DP_CP)
        mesh[(*data_dims, "cp")]._flatten(DP_CP)
    return mesh


def _coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """This rank's (pp, dp, tp) coordinates in the row-major (pp, dp, cp, tp) layout the mesh has."""
    tp, cp, dp = sizes["tp_size"], sizes["cp_size"], sizes["dp_size"]
    return {"tp": rank % tp, "dp": (rank // (cp * tp)) % dp, "pp": rank // (dp * cp * tp)}


def _mesh_rank(mesh: Any, name: str, fallback: int) -> int:
    """This rank's coordinate along mesh dim `name`; `fallback` when the mesh has no such dim (size 1)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return fallback
    return mesh.get_local_rank(name)


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
        if owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        _ATTEMPT_STORE.clear()


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
    sizes = _parallel_sizes(parallel, launch.world_size)
    device_type = devices.resolve_device_type(config.device)
    backend = resolve_backend(config.backend, device_type)
    device = devices.local_device(device_type, launch.local_rank)

    flags = _global_flags()
    precision_flags: dict[str, bool] = {}
    owns_group = False
    runtime = Runtime(device=device, seed=seed)
    try:
        precision_flags = _set_process_flags(config, device_type, seed, env)
        devices.set_device(device)
        owns_group = _join_process_group(launch, backend, config.timeout_s, device)
        runtime = _make_runtime(config, parallel, launch, sizes, device, backend, owns_group, seed)
    except BaseException:
        _teardown_after_error(runtime, owns_group, flags, device_type, precision_flags)
        raise

    try:
        yield runtime
    except BaseException:
        _teardown_after_error(runtime, owns_group, flags, device_type, precision_flags)
        raise
    try:
        teardown_runtime(runtime, clean=True, owns_group=owns_group)
    finally:
        _restore_global_flags(flags)
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


def _join_process_group(launch: LaunchEnv, backend: str, timeout_s: float, device: torch.device) -> bool:
    """Initialise the process group of a launched process unless one exists; True when this call made it
    (then this runtime owns it and destroys it at exit)."""
    already = dist.is_available() and dist.is_initialized()
    if not launch.launched or already:
        return False
    try:
        _init_process_group(backend, timeout_s, device)
    except Exception as error:
        _note_restart_hint(error)
        raise
    return True


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
    mesh = _build_mesh(device.type, sizes, replicate) if distributed else None
    coordinates = _coordinates(launch.rank, sizes)
    dp_rank = mesh.get_local_rank("dp") if mesh is not None else coordinates["dp"]
    from_mesh = {dim: _mesh_rank(mesh, dim, coordinates[dim]) for dim in ("tp", "pp")} | {"dp": dp_rank}
    if from_mesh != coordinates:  # the plan printout and the profiler's stage leaders use the arithmetic
        raise RuntimeError(
            f"rank {launch.rank}: mesh coordinates {from_mesh} differ from the layout's {coordinates}"
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
        cp_rank=_mesh_rank(mesh, "cp", (launch.rank // sizes["tp_size"]) % sizes["cp_size"]),
        backend=(dist.get_backend() if not owns_group else backend) if distributed else None,
        mesh=mesh,
        seed=seed,
        parallel_mode=parallel.strategy if parallel is not None else "none",
    )
    if runtime.is_main:
        log.info(
            "runtime: world %d, device %s, backend %s, dp %d (rank %d), tp %d, pp %d, cp %d, seed %d%s",
            runtime.world_size, device, runtime.backend, runtime.dp_size, runtime.dp_rank, runtime.tp_size,
            runtime.pp_size, runtime.cp_size, runtime.seed, ", deterministic" if config.deterministic else "",
        )  # fmt: skip
    return runtime


def _teardown_after_error(
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
        _restore_global_flags(flags)
        try:
            devices.restore_precision_flags(device_type, precision_flags)
        except Exception:
            log.exception("restoring precision flags failed while handling another error")
