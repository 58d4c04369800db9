"""Training FLOPs per token of a model: counted on a meta-device copy, or the dense-transformer formula.

`measure_flops_per_token` runs one forward (and backward) of a meta copy of the model under
`torch.utils.flop_counter.FlopCounterMode`: no memory is allocated and nothing runs on the device, so it
costs a fraction of a second at the start of a run. The throughput hook turns the number into TFLOP/s
and MFU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from fntrain.data.tokens import count_tokens
from fntrain.step import default_forward

__all__ = ["measure_flops_per_token", "dense_transformer_flops_per_token"]


def dense_transformer_flops_per_token(n_params: int, n_layers: int, d_model: int, context: int) -> float:
    """Training FLOPs per token of a dense decoder: 6 N + 12 L d T (PaLM, appendix B).

    6 N covers the forward and backward matmuls of the N parameters, 12 L d T the attention scores and
    values over a context of T tokens (not halved for the causal mask).
    """
    return 6.0 * n_params + 12.0 * n_layers * d_model * context


def _meta_copy(model: Any) -> torch.nn.Module:
    """A copy of `model` on the meta device, allocating no memory: a module's parameters and buffers are
    replaced through deepcopy's memo (ties kept); a zero-argument factory is called under the meta device."""
    if not isinstance(model, torch.nn.Module):
        with torch.device("meta"):
            return model()
    memo: dict[int, Any] = {}
    for param in model.parameters():
        if id(param) not in memo:
            memo[id(param)] = torch.nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    for buffer in model.buffers():
        memo.setdefault(id(buffer), torch.empty_like(buffer, device="meta"))
    return copy.deepcopy(model, memo)


def measure_flops_per_token(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    example_batch: Mapping[str, Any],
    *,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None,
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] | None = None,
    backward: bool = True,
) -> float:
    """Training FLOPs per token, counted by FlopCounterMode over one forward (and backward) on meta.

    `model` is an unwrapped module (copied to meta through deepcopy's memo) or a factory called under
    the meta device. `example_batch` is one micro-batch of host tensors; its tokens are counted like the
    loop counts them (`count_tokens`), so FLOPs per step = this x the step's tokens for batches of that
    shape. Backward uses `loss_fn(output, batch)`, else the output's sum. A padded batch's 2-D
    `attention_mask` is left out of the meta forward: the kernels compute the padded positions all the
    same (the count depends on shapes only), and a model that inspects its mask (transformers asks
    whether it is all ones) cannot read a meta tensor.
    """
    from torch.utils.flop_counter import FlopCounterMode

    tokens = int(count_tokens(example_batch))
    if tokens <= 0:
        raise ValueError(f"the example batch must hold at least one token, got {tokens}")
    meta_model = _meta_copy(model)
    shapes_only = dict(example_batch)
    mask = shapes_only.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        del shapes_only["attention_mask"]
    meta_batch = optree.tree_map(
        lambda leaf: leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf, shapes_only
    )
    forward = forward or default_forward
    with FlopCounterMode(display=False) as counter:
        output = forward(meta_model, meta_batch)
        if backward:
            if loss_fn is not None:
                loss = loss_fn(output, meta_batch)
            else:
                loss = (output.logits if hasattr(output, "logits") else output).sum()
            if loss.requires_grad:
                loss.backward()
    return counter.get_total_flops() / tokens
