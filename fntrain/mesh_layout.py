"""Which rank sits where on the runtime's DeviceMesh, as plain arithmetic (no torch, no process group).

The runtime builds its mesh over ("pp", "dp", "cp", "tp") in that row-major order, pp outermost and tp
innermost, dropping dims of size 1 except "dp"; under HSDP "dp" is laid out as ("dp_replicate",
"dp_shard"), under expert parallelism as ("dp_mod_ep", "ep") (`fntrain.runtime.mesh.build_mesh`). `mesh_dims` reproduces that list of dims and
`rank_coordinates` / `group_ranks` unravel a global rank over it, so the plan printout and the profiler's
pipeline-stage leaders agree with the real mesh by construction.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["mesh_dims", "rank_coordinates", "group_ranks", "stage_leaders"]

MeshDims = tuple[tuple[str, int], ...]


def mesh_dims(
    world_size: int, *, tp_size: int = 1, pp_size: int = 1, cp_size: int = 1, replicate: int = 1,
    ep_size: int = 1,
) -> MeshDims:
    """The (name, size) dims of the runtime mesh for `world_size` ranks, outermost first: "pp", "dp"
    (or "dp_replicate", "dp_shard" when `replicate` > 1), "cp", "tp"; sizes of 1 dropped except the
    data-parallel ones. With `ep_size` > 1 "dp" is laid out as ("dp_mod_ep", "ep"): experts are sharded
    over part of the data-parallel ranks (ep must divide dp; not with HSDP). Raises `ValueError` naming the field when the sizes do not divide the world."""
    for name, size in (
        ("tp_size", tp_size),
        ("pp_size", pp_size),
        ("cp_size", cp_size),
        ("replicate", replicate),
        ("ep_size", ep_size),
    ):
        if type(size) is not int or size < 1:
            raise ValueError(f"parallel.{name} must be an int >= 1, got {size!r}")
    model_parallel = tp_size * pp_size * cp_size
    if world_size < 1 or world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} must be divisible by parallel.tp_size x pp_size x cp_size "
            f"= {tp_size} x {pp_size} x {cp_size} = {model_parallel}"
        )
    dp_size = world_size // model_parallel
    if dp_size % replicate:
        raise ValueError(f"parallel.replicate ({replicate}) must divide the data-parallel size ({dp_size})")
    data = (
        (("dp_replicate", replicate), ("dp_shard", dp_size // replicate))
        if replicate > 1
        else (("dp", dp_size),)
    )
    if ep_size > 1:
        if dp_size % ep_size or replicate > 1:
            raise ValueError(f"parallel.ep_size ({ep_size}) must divide the data-parallel size ({dp_size}), without HSDP")
        data = (("dp_mod_ep", dp_size // ep_size), ("ep", ep_size))
    dims = (("pp", pp_size), *data, ("cp", cp_size), ("tp", tp_size))
    return tuple((name, size) for name, size in dims if name.startswith("dp") or size > 1)


def rank_coordinates(rank: int, dims: MeshDims) -> dict[str, int]:
    """`rank`'s coordinate on every dim of `dims` (row-major, the last dim fastest), plus "dp" (the
    flattened data-parallel coordinate, replicate-major) under HSDP."""
    world = _world(dims)
    if type(rank) is not int or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    coords: dict[str, int] = {}
    rest = rank
    for name, size in reversed(dims):
        rest, coords[name] = divmod(rest, size)
    coords = {name: coords[name] for name, _ in dims}  # outermost first, as the dims read
    if "dp_shard" in coords:
        coords["dp"] = coords["dp_replicate"] * dict(dims)["dp_shard"] + coords["dp_shard"]
    if "ep" in coords:
        coords["dp"] = coords["dp_mod_ep"] * dict(dims)["ep"] + coords["ep"]
    return coords


def group_ranks(rank: int, dims: MeshDims, dim: str | Sequence[str]) -> list[int]:
    """The global ranks of `rank`'s group along `dim` (one name, or several flattened; "dp" under HSDP
    is ("dp_replicate", "dp_shard")): every rank whose other coordinates equal `rank`'s, ascending."""
    sizes = dict(dims)
    names = (dim,) if isinstance(dim, str) else tuple(dim)
    if names == ("dp",) and "dp" not in sizes:
        names = ("dp_mod_ep", "ep") if "ep" in sizes else ("dp_replicate", "dp_shard")
    unknown = [name for name in names if name not in sizes]
    if unknown:
        raise ValueError(f"mesh dim {unknown[0]!r} is not one of {[name for name, _ in dims]}")
    own = rank_coordinates(rank, dims)
    return [
        other
        for other in range(_world(dims))
        if all(c == own[n] for n, c in rank_coordinates(other, dims).items() if n in sizes and n not in names)
    ]


def stage_leaders(world_size: int, pp_size: int) -> list[int]:
    """The first global rank of each pipeline stage: the rank at pp coordinate s and 0 on every other
    dim. pp is outermost, so that is s * world_size / pp_size whatever the other dims are."""
    dims = mesh_dims(world_size, pp_size=pp_size)
    if "pp" not in dict(dims):
        return [0]
    return group_ranks(0, dims, "pp")  # rank 0's pp group: every other coordinate 0


def _world(dims: MeshDims) -> int:
    world = 1
    for _, size in dims:
        world *= size
    return world
