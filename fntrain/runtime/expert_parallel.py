"""Expert parallelism: experts sharded over the mesh's "ep" dim, tokens exchanged with all-to-all.

A module takes part when it carries an int `num_experts` and an `ep_group` attribute (None: every
expert is local) and every parameter it owns directly holds the experts on dim 0
(`fntrain.models.moe.GroupedExperts`). `shard_experts` makes those parameters DTensors sharded on dim
0 over the ep mesh, so a checkpoint holds each weight at its global shape, keyed by global expert
index: torch.distributed.checkpoint reshards it on load at any ep size, optimizer moments included.
FSDP2 then shards them further over "dp_mod_ep" (torchtitan's layout): the ep dim is borrowed from the
data-parallel dim, laid out as ("dp_mod_ep", "ep") and flattened back into "dp".

The token exchange is torch's autograd all-to-all (`_functional_collectives.all_to_all_single_autograd`,
what torchtitan uses; `torch.distributed.nn.functional.all_to_all_single` is deprecated for it): its
backward is the reverse exchange. The uneven split sizes are host lists, so each exchange reads the
token counts on the host once (one sync per MoE layer and micro-batch, as every dropless all-to-all
dispatch without device-side splits has).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["EP_DIMS", "expert_modules", "shard_experts", "Exchange", "plan_exchange", "dispatch", "combine"]

EP_DIMS = ("dp_mod_ep", "ep")  # the runtime mesh's data-parallel dims under ep > 1, flattened into "dp"


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose own parameters hold experts on dim 0 (see the module docstring)."""
    return [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int) and hasattr(m, "ep_group")]


def shard_experts(model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
    """Shard every expert module's parameters on dim 0 over the 1-D `ep_mesh` (DTensors, Shard(0)) and
    point its `ep_group` at the mesh's group; the experts modules are returned. `num_experts` must be
    a multiple of the mesh size (ValueError naming both)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"--parallel.ep-size {ep_mesh.size()}: this model has no experts to shard")
    for module in modules:
        if module.num_experts % ep_mesh.size():
            raise ValueError(
                f"--parallel.ep-size {ep_mesh.size()} must divide the number of experts ({module.num_experts})"
            )
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.ep_group = ep_mesh.get_group()
    return modules


@dataclass(frozen=True)
class Exchange:
    """How one micro-batch's tokens travel: rows sent to / received from each ep rank, the order that
    groups the received rows by local expert, and the rows each local expert gets."""

    send_splits: list[int]
    recv_splits: list[int]
    order: torch.Tensor  # received row -> position in local-expert-major order
    local_counts: list[int]


def plan_exchange(counts: torch.Tensor, group: Any) -> Exchange:
    """The exchange of rows sorted by global expert, `counts[e]` of them for expert e (int64, on the
    device), over the ep `group`: the counts are exchanged first (every rank learns how many rows it
    gets for each of its experts from each peer), then read on the host for the split sizes."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    sent_host, received_host = torch.stack([counts, received]).tolist()  # the split sizes' host sync
    send_splits = [sum(sent_host[r * local : (r + 1) * local]) for r in range(ep)]
    recv_splits = [sum(received_host[r * local : (r + 1) * local]) for r in range(ep)]
    # Received rows come source-rank-major, each source's rows sorted by local expert.
    expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(received)
    order = torch.argsort(expert_of_row, stable=True)
    local_counts = [sum(received_host[expert::local]) for expert in range(local)]
    return Exchange(send_splits, recv_splits, order, local_counts)


def _all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as collectives

    out = collectives.all_to_all_single_autograd(x.contiguous(), list(output_splits), list(input_splits), group)
    return collectives.wait_tensor(out)


def dispatch(rows: torch.Tensor, exchange: Exchange, group: Any) -> torch.Tensor:
    """Rows sorted by global expert -> the rows of this rank's experts, sorted by local expert."""
    return _all_to_all(rows, exchange.recv_splits, exchange.send_splits, group)[exchange.order]


def combine(rows: torch.Tensor, exchange: Exchange, group: Any) -> torch.Tensor:
    """The inverse of `dispatch`: local experts' outputs back to the ranks (and order) they came from."""
    back = torch.empty_like(rows).index_copy(0, exchange.order, rows)
    return _all_to_all(back, exchange.send_splits, exchange.recv_splits, group)
