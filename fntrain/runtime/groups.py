"""Where the runtime mesh keeps the groups a layout needs: the data-parallel group gradients are averaged
over, the context-parallel sub-mesh, this rank's pipeline group, and the HSDP shape of the dp ranks.

The dim names are the ones `fntrain.runtime.setup` gives the DeviceMesh it builds; everything here only
looks them up (plain functions of a `Runtime`, no process-group calls beyond `get_group`).
"""

from __future__ import annotations

from typing import Any

from fntrain.runtime.runtime import Runtime

__all__ = [
    "HSDP_DIMS", "DP_CP", "hsdp_shape", "mesh_has_dims", "data_parallel_group", "gradient_group_size",
    "context_parallel_mesh", "pipeline_group",
]  # fmt: skip

HSDP_DIMS = ("dp_replicate", "dp_shard")  # the runtime mesh's dims under HSDP, flattened into "dp"
DP_CP = "dp_cp"  # the runtime mesh's (dp, cp) dims flattened: the group gradients are averaged over


def hsdp_shape(dp_size: int, replicate: int, prefix: str = "parallel") -> tuple[int, int]:
    """(replicas, shards) of an HSDP layout of `dp_size` data-parallel ranks; `replicate` must divide it."""
    if replicate < 1 or dp_size % replicate:
        raise ValueError(f"{prefix}.replicate ({replicate}) must divide the data-parallel size ({dp_size})")
    return replicate, dp_size // replicate


def mesh_has_dims(mesh: Any, *names: str) -> bool:
    """Whether `mesh` can be indexed by every dim in `names`, flattened ones (HSDP's "dp") included."""
    names_in_mesh = set(mesh.mesh_dim_names or ())
    try:  # dims flattened from others (HSDP's "dp") live on the root mesh
        names_in_mesh |= set(mesh._get_root_mesh()._flatten_mapping)
    except AttributeError:
        pass
    return all(name in names_in_mesh for name in names)


def data_parallel_group(runtime: Runtime) -> Any:
    """The process group of this rank's data-parallel peers (None: the default group or no group);
    with context parallelism the (dp x cp) group, over which gradients are averaged."""
    mesh = runtime.mesh
    if mesh is None:
        return None
    if runtime.cp_size > 1:  # the cp ranks of a replica hold the same weights: gradients reduce over dp x cp
        return mesh.get_group(DP_CP)
    if mesh_has_dims(mesh, "dp"):
        return mesh.get_group("dp")  # a mesh dim, or HSDP's (dp_replicate, dp_shard) flattened
    return mesh.get_group()


def gradient_group_size(runtime: Runtime) -> int:
    """Ranks `data_parallel_group` holds: dp, times cp under context parallelism (the step's dp_size)."""
    return runtime.dp_size * runtime.cp_size


def context_parallel_mesh(runtime: Runtime) -> Any:
    """The runtime mesh's 1-D "cp" sub-mesh; None without context parallelism."""
    return runtime.mesh["cp"] if runtime.cp_size > 1 else None


def pipeline_group(runtime: Runtime) -> Any:
    """This rank's pipeline group (its peers in the other stages); None without pipeline parallelism."""
    return runtime.mesh.get_group("pp") if runtime.pp_size > 1 else None
