"""Expert parallelism for transformers' MoE experts modules (Qwen2-MoE, Qwen3-MoE, Mixtral).

    modules = enable_expert_parallel(model)   # before `parallelize`; then --parallel.ep-size N shards them

transformers 5 keeps a MoE layer's experts in one module (`Qwen3MoeExperts`, `Qwen2MoeExperts`,
`MixtralExperts`): `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], experts on dim 0, and
forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]). `enable_expert_parallel` gives
each such module an `ep_group` attribute (None) and an ep-aware forward, so that
`fntrain.runtime.expert_parallel.shard_experts` finds it, shards its two weights over the ep mesh and
sets `ep_group`. With `ep_group` None the module runs transformers' own forward, untouched. With a group
each (token, k) row travels to the rank owning its expert (`plan_exchange` / `dispatch`), the local
experts run on their rows with transformers' math (the module's own `_apply_gate`: act(gate) x up, then
down; the output scaled by its router weight), and the rows come back (`combine`) to be summed into
their tokens, the pattern of `fntrain.models.moe.GroupedExperts`.

Only that layout is taken: a module with transposed, interleaved or biased weights (e.g. gpt-oss) is
refused with a ValueError rather than computed wrongly.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fntrain.models.moe import expert_counts
from fntrain.runtime.expert_parallel import combine, dispatch, plan_exchange

__all__ = [
    "hf_experts_modules",
    "enable_expert_parallel",
    "expert_parallel_forward",
    "config_num_experts",
    "check_expert_parallel",
]

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")  # Qwen2/3-MoE, Mixtral


def config_num_experts(saved: dict[str, Any]) -> int | None:
    """The routed experts per layer a config.json (as a dict) names; None for a dense model."""
    text = saved.get("text_config") or saved  # multimodal configs nest the language model's
    for key in _EXPERT_COUNT_KEYS:
        if isinstance(text.get(key), int) and not isinstance(text.get(key), bool) and text[key] > 0:
            return text[key]
    return None


def _is_hf_experts(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return (
        isinstance(getattr(module, "num_experts", None), int)
        and {"gate_up_proj", "down_proj"} <= params.keys()
        and all(params[name].dim() == 3 for name in ("gate_up_proj", "down_proj"))
    )


def hf_experts_modules(model: nn.Module) -> list[nn.Module]:
    """The transformers experts modules of `model` (3-D `gate_up_proj` / `down_proj` and an int
    `num_experts`); a ValueError for one whose layout this forward does not compute (transposed,
    interleaved gate/up, biases or other parameters)."""
    found = [module for module in model.modules() if _is_hf_experts(module)]
    for module in found:
        odd = [name for name in ("is_transposed", "has_bias") if getattr(module, name, False)]
        odd += [] if getattr(module, "is_concatenated", True) else ["interleaved gate/up"]
        odd += [] if hasattr(module, "_apply_gate") else ["no _apply_gate"]
        extra = sorted(set(dict(module.named_parameters(recurse=False))) - {"gate_up_proj", "down_proj"})
        if odd or extra:
            raise ValueError(
                f"parallel.ep_size: {type(module).__name__} has a layout expert parallelism does not "
                f"support ({', '.join(odd + extra)})"
            )
    return found


def enable_expert_parallel(model: nn.Module) -> list[nn.Module]:
    """Give every transformers experts module of `model` an `ep_group = None` and the ep-aware forward
    (in place; idempotent); returns the modules (empty for a dense model)."""
    modules = hf_experts_modules(model)
    for module in modules:
        if not hasattr(module, "ep_group"):
            module.ep_group = None
            # An instance attribute: nn.Module.__call__ reaches it, FSDP2's class swap keeps it, and
            # deepcopy rebinds it to the copy.
            module.forward = types.MethodType(_ep_aware_forward, module)
    return modules


def _ep_aware_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' own forward (its class's, whatever experts implementation it picks) while
    `ep_group` is None; `expert_parallel_forward` once `shard_experts` set it."""
    if self.ep_group is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    return expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights)


def expert_parallel_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' experts forward over `module.ep_group`: [T, H] in, [T, H] out, every (token, k)
    row computed on the rank that holds its expert."""
    group, top_k = module.ep_group, top_k_index.size(-1)
    order = torch.argsort(top_k_index.reshape(-1), stable=True)  # rows sorted by global expert
    token_of_row = order // top_k
    exchange = plan_exchange(expert_counts(top_k_index, module.num_experts), group)
    local = _run_local_experts(
        module, dispatch(hidden_states[token_of_row], exchange, group), exchange.local_counts
    )
    rows = combine(local, exchange, group) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden_states).index_add(0, token_of_row, rows.to(hidden_states.dtype))


def _run_local_experts(module: nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This rank's experts over their slices of `rows` (sorted by local expert); an expert with no
    rows still joins the graph, so its gradient is zero rather than missing."""
    gate_up, down = (
        w.to_local() if hasattr(w, "to_local") else w for w in (module.gate_up_proj, module.down_proj)
    )
    pieces = torch.split(rows, counts)
    return torch.cat([
        nn.functional.linear(module._apply_gate(nn.functional.linear(piece, gate_up[e])), down[e])
        for e, piece in enumerate(pieces)
    ])  # fmt: skip


def check_expert_parallel(model_path: str, ep_size: int, *, lora: bool = False) -> None:
    """A ValueError, before any model work, when `parallel.ep_size` > 1 meets a dense model (its
    config.json names no experts), a number of experts it does not divide, or LoRA (peft's adapters
    are not sharded over ep). Call it from a recipe's validate."""
    if ep_size == 1:
        return
    saved = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    experts = config_num_experts(saved) if isinstance(saved, dict) else None
    if experts is None:
        raise ValueError(
            f"parallel.ep_size={ep_size} needs a mixture-of-experts model: model.path's config.json names no "
            f"experts ({' / '.join(_EXPERT_COUNT_KEYS)})"
        )
    if experts % ep_size:
        raise ValueError(
            f"parallel.ep_size ({ep_size}) must divide the model's number of experts ({experts})"
        )
    if lora:
        raise ValueError(
            f"lora.rank > 0 cannot be combined with parallel.ep_size={ep_size} yet: turn one off"
        )
