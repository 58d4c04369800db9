"""A mixture-of-experts feed-forward layer: token-choice top-k routing, dropless dispatch, balancing.

    moe = MoE(d_model=128, hidden=512, experts=8, top_k=2, shared=1, aux_loss_weight=0.01)
    y = moe(x)                              # [batch, seq, d_model]; moe.aux_loss: the weighted aux term

- **Router** (`route`): softmax over the experts' logits in fp32, then the top-k, whose weights are
  renormalised to sum to 1: Qwen2/3-MoE with norm_topk_prob, and the same numbers as Mixtral's softmax
  over the top-k logits. With bias balancing the bias is added to the probabilities only to choose the
  experts (DeepSeek-V3); the weights stay the unbiased probabilities, renormalised.
- **Dropless dispatch** (`MoE.forward`): the token-expert pairs are sorted by expert (a stable sort, so
  runs are reproducible), each expert runs on its contiguous slice, the outputs are scattered back and
  summed with the router weights. No capacity factor: no token is ever dropped. Slicing needs the
  counts on the host: one read per layer and micro-batch (a grouped GEMM would avoid it where torch has
  one with a backward; on CPU `torch._grouped_mm` has none). Under expert parallelism the slices travel
  with all-to-all (`fntrain.runtime.expert_parallel`).
- **Load-balancing loss** (`load_balancing_loss`, Switch Transformer / Mixtral): E x sum_e f_e P_e, with
  f_e the fraction of the token-expert pairs routed to e and P_e the mean router probability of e; 1.0
  when perfectly balanced (transformers' form is top_k times this). The layer keeps
  `aux_loss_weight x` it as `aux_loss` after each training forward; the model averages its layers'
  terms into its output and `loss_with_router_aux` adds that to the cross-entropy, so the step weighs
  it like the micro-batch's loss (token mode: by the micro-batch's share of the step's tokens).
- **Loss-free balancing** (`update_expert_bias`, DeepSeek-V3): after each optimizer step, outside
  autograd, bias += rate x sign(mean load - load) from the step's tokens per expert summed over the
  data-parallel ranks; `expert_bias` is a persistent buffer, so checkpoints carry it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fntrain.runtime.expert_parallel import combine, dispatch, plan_exchange
from fntrain.step import causal_lm_loss

__all__ = [
    "Routing",
    "route",
    "expert_counts",
    "load_balancing_loss",
    "update_expert_bias",
    "GroupedExperts",
    "MoE",
    "RouterOutput",
    "moe_layers",
    "loss_with_router_aux",
    "moe_step_end",
]


@dataclass(frozen=True)
class Routing:
    """One micro-batch's routing: probabilities [tokens, E] (fp32), chosen experts and their weights
    [tokens, k], tokens per expert [E] (int64)."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many token-expert pairs each expert got (int64 [E]); a scatter_add, so it also runs on meta."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def route(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None) -> Routing:
    """Token-choice top-k over router `logits` [tokens, E]: softmax (fp32), top-k (by probability +
    `bias` when given: selection only), the chosen probabilities renormalised to sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    scores = probs if bias is None else probs + bias
    experts = torch.topk(scores, top_k, dim=-1).indices
    chosen = probs.gather(-1, experts)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    return Routing(probs, experts, weights, expert_counts(experts, logits.size(-1)))


def load_balancing_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/Mixtral's auxiliary loss E x sum_e f_e P_e (f_e = counts_e / (tokens x k), P_e = mean
    probability of e); 1.0 for a uniform router. Only P carries a gradient (f is a count)."""
    num_tokens, num_experts = probs.shape
    fraction = counts.to(probs.dtype) / max(num_tokens * top_k, 1)
    return num_experts * (fraction * probs.mean(dim=0)).sum()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's loss-free balancing, in place: bias += rate x sign(mean(load) - load)."""
    load = load.to(bias.dtype)
    bias.add_(torch.sign(load.mean() - load), alpha=rate)


class GroupedExperts(nn.Module):
    """E GELU MLPs stacked on dim 0 (w_in [E, d, h], w_out [E, h, d]), run on rows sorted by expert.
    Under expert parallelism (`fntrain.runtime.expert_parallel.shard_experts`) the weights are DTensors
    sharded on the experts and `ep_group` is set: rows then travel to their experts' rank and back."""

    def __init__(self, num_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.num_experts = num_experts
        self.ep_group: Any = None
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows [n, d] sorted by global expert, `counts[e]` of them for expert e -> outputs [n, d]."""
        w_in, w_out = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w_in, self.w_out))
        if self.ep_group is None:
            return _run_experts(rows, w_in, w_out, _host_counts(counts, rows.size(0)))
        exchange = plan_exchange(counts, self.ep_group)
        local = _run_experts(dispatch(rows, exchange, self.ep_group), w_in, w_out, exchange.local_counts)
        return combine(local, exchange, self.ep_group)


def _host_counts(counts: torch.Tensor, rows: int) -> list[int]:
    """The counts as host ints (the dispatch's one read); on meta (FLOP counting) an even split."""
    if counts.is_meta:
        base, extra = divmod(rows, counts.numel())
        return [base + (e < extra) for e in range(counts.numel())]
    return counts.tolist()


def _run_experts(rows: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert e's MLP over its slice of `rows`; an expert with no rows still joins the graph (zero grads)."""
    pieces = torch.split(rows, counts)
    return torch.cat([F.gelu(piece @ w_in[e]) @ w_out[e] for e, piece in enumerate(pieces)])


class MoE(nn.Module):
    """The MoE feed-forward: router, routed experts, optional shared experts (one dense MLP of
    `shared` x `hidden` units that every token passes through, DeepSeek/Qwen2-MoE style)."""

    def __init__(self, d_model: int, hidden: int, experts: int, top_k: int, *, shared: int = 0,
                 aux_loss_weight: float = 0.0, bias_rate: float = 0.0):  # fmt: skip
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"experts_per_token must be in [1, {experts}], got {top_k}")
        self.top_k, self.aux_loss_weight, self.bias_rate = top_k, aux_loss_weight, bias_rate
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = GroupedExperts(experts, d_model, hidden)
        self.shared = (
            nn.Sequential(nn.Linear(d_model, shared * hidden), nn.GELU(), nn.Linear(shared * hidden, d_model))
            if shared else None
        )  # fmt: skip
        self.register_buffer("expert_bias", torch.zeros(experts))  # persistent: checkpoints carry it
        # Training forwards since the last step end: tokens per expert and the aux loss, on the device.
        self.register_buffer("step_load", torch.zeros(experts, dtype=torch.int64), persistent=False)
        self.register_buffer("step_aux", torch.zeros(()), persistent=False)
        self.step_forwards = 0  # a host count: no sync
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.size(-1))
        routing = route(self.router(rows), self.top_k, self.expert_bias if self.bias_rate > 0 else None)
        order = torch.argsort(routing.experts.reshape(-1), stable=True)
        token_of_pair = order // self.top_k
        out_sorted = self.experts(rows[token_of_pair], routing.counts)
        weighted = out_sorted * routing.weights.reshape(-1)[order].unsqueeze(-1).to(out_sorted.dtype)
        out = torch.zeros_like(rows).index_add(0, token_of_pair, weighted.to(rows.dtype))
        if self.shared is not None:
            out = out + self.shared(rows)
        self.aux_loss = None
        if self.training:
            aux = load_balancing_loss(routing.probs, routing.counts, self.top_k)
            self.aux_loss = self.aux_loss_weight * aux if self.aux_loss_weight > 0 else None
            with torch.no_grad():
                self.step_load += routing.counts
                self.step_aux += aux.detach()
            self.step_forwards += 1
        return out.view_as(x)


@dataclass(frozen=True)
class RouterOutput:
    """A MoE model's output: the logits and the weighted router loss of this forward (None in eval
    mode or with a zero weight). `causal_lm_loss` reads `.logits`."""

    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of `model`, in module order (the layer index of the metrics)."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def mean_aux_loss(layers: list[MoE]) -> torch.Tensor | None:
    """The layers' weighted aux terms of their last forward, averaged (None when none has one)."""
    terms = [layer.aux_loss for layer in layers if layer.aux_loss is not None]
    return torch.stack(terms).mean() if terms else None


def loss_with_router_aux(output: Any, micro_batch: Mapping[str, Any]) -> torch.Tensor:
    """`causal_lm_loss` plus the output's weighted router loss when it has one (a MoE model in
    training); plain cross-entropy otherwise, so evaluation reports the language-model loss only."""
    loss = causal_lm_loss(output, micro_batch)
    aux = getattr(output, "aux_loss", None)
    return loss if aux is None else loss + aux.to(loss.dtype)


def moe_step_end(model: nn.Module, dp_group: Any = None) -> Callable[[], dict[str, torch.Tensor]]:
    """`step_end() -> metrics`, for the step to call after each optimizer update: the loss-free bias
    update of the layers that use it (tokens per expert summed over `dp_group`: every rank keeps the
    same bias; one all_reduce for all layers), then the step's figures as device tensors, and the
    layers' accumulators reset. Metrics: "moe/aux_loss" (unweighted, mean over layers and forwards)
    and "moe/load_max_mean/<layer>" (this rank's max over mean tokens per expert; 1.0 is balanced)."""
    layers = moe_layers(model)
    balanced = [layer for layer in layers if layer.bias_rate > 0]
    reduce_load = dist.is_available() and dist.is_initialized() and dist.get_world_size(dp_group) > 1

    @torch.no_grad()
    def step_end() -> dict[str, torch.Tensor]:
        if not layers or layers[0].step_forwards == 0:
            return {}
        if balanced:
            load = torch.stack([layer.step_load for layer in balanced])
            if reduce_load:
                dist.all_reduce(load, group=dp_group)
            for layer, layer_load in zip(balanced, load, strict=True):
                update_expert_bias(layer.expert_bias, layer_load, layer.bias_rate)
        metrics = {"moe/aux_loss": torch.stack([layer.step_aux / layer.step_forwards for layer in layers]).mean()}
        for index, layer in enumerate(layers):
            load = layer.step_load.float()
            metrics[f"moe/load_max_mean/{index}"] = load.max() / load.mean().clamp(min=1e-9)
            layer.step_load.zero_()
            layer.step_aux.zero_()
            layer.step_forwards = 0
        return metrics

    return step_end
