"""The DeviceMesh of a run: the parallel sizes a world implies, the mesh over them, and this rank's
coordinates in it (row-major over pp, dp, cp, tp, as `fntrain.mesh_layout` reproduces without torch)."""

from __future__ import annotations

from typing import Any

from fntrain.runtime.expert_parallel import EP_DIMS
from fntrain.runtime.groups import DP_CP, HSDP_DIMS, hsdp_shape
from fntrain.runtime.parallel import ParallelConfig

__all__ = ["parallel_sizes", "build_mesh", "coordinates", "mesh_rank"]


def parallel_sizes(parallel: ParallelConfig | None, world_size: int) -> dict[str, int]:
    """tp/pp/cp/ep sizes from `parallel` (1 without one) and the data-parallel size they leave,
    `dp_size = world / (tp * pp * cp)`; a ValueError when they do not divide the world."""
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


def build_mesh(device_type: str, sizes: dict[str, int], replicate: int = 1) -> Any:
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
    if sizes["cp_size"] > 1:  # gradients reduce over dp x cp (fntrain.runtime.groups.DP_CP)
        mesh[(*data_dims, "cp")]._flatten(DP_CP)
    return mesh


def coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """This rank's (pp, dp, tp) coordinates in the row-major (pp, dp, cp, tp) layout the mesh has."""
    tp, cp, dp = sizes["tp_size"], sizes["cp_size"], sizes["dp_size"]
    return {"tp": rank % tp, "dp": (rank // (cp * tp)) % dp, "pp": rank // (dp * cp * tp)}


def mesh_rank(mesh: Any, name: str, fallback: int) -> int:
    """This rank's coordinate along mesh dim `name`; `fallback` when the mesh has no such dim (size 1)."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return fallback
    return mesh.get_local_rank(name)
