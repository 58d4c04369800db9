"""Context parallelism over the runtime mesh's "cp" dim: every cp rank of a data-parallel group gets the
same micro-batch and computes on its own slice of each sequence.

    shard_micro_batch(mb, rank, size)       this rank's contiguous slice of a micro-batch
    seq_to_heads(x, group) / heads_to_seq   Ulysses' all-to-alls: [B, H, S/cp, D] <-> [B, H/cp, S, D]
    ulysses_sdpa(q, k, v, ..., group)       scaled_dot_product_attention over the whole sequence
    context_parallel_parts(...)             the step's and evaluation's forward and losses under cp

Ulysses (DeepSpeed-Ulysses, any backend): outside attention every op is per token, so each rank keeps
S/cp tokens; around attention one all-to-all trades the sequence split for a head split, attention runs
over the whole sequence for H/cp heads, and a second all-to-all trades back. The model is not edited:
while the cp forward runs, `F.scaled_dot_product_attention` is routed to `ulysses_sdpa` by a
TorchFunctionMode. Ring attention (`cp_style="ring"`) is torch's own
`torch.distributed.tensor.experimental` dispatcher, which has no CPU kernel.

The slice keeps the global view: position ids are the global ones, next-token targets are taken from
the whole sequence before slicing (the last token of a slice predicts the first of the next), and a 4-D
document mask stays whole (attention sees the whole sequence). Loss: each rank's token-mean over its
slice times its share of the micro-batch's tokens is its part of the whole micro-batch's token mean;
x cp undoes the 1/cp of gradient averaging over the (dp x cp) group, so the step's token weighting
(`fntrain.step.train_step`) composes unchanged: dp x cp.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol  # already loaded by torch.distributed
from torch.overrides import TorchFunctionMode

from fntrain.data.tokens import IGNORE_INDEX, count_loss_tokens, loss_targets
from fntrain.runtime.parallel import CP_STYLES

__all__ = [
    "CP_STYLES",
    "shard_micro_batch",
    "seq_to_heads",
    "heads_to_seq",
    "to_heads",
    "to_seq",
    "ulysses_sdpa",
    "ulysses_attention",
    "CPOutput",
    "context_parallel_parts",
]

_SLICED = ("input_ids", "shift_labels", "position_ids")


def _full_targets(micro_batch: Mapping[str, Any], ignore_index: int) -> torch.Tensor:
    """Next-token targets aligned with the inputs ([B, S]: position t's target), invalid ones
    `ignore_index`; taken from the whole sequence so that no slice loses its boundary target."""
    targets, valid = loss_targets(micro_batch, ignore_index)
    targets = targets.masked_fill(~valid, ignore_index)
    if "shift_labels" in micro_batch:
        return targets
    pad = targets.new_full((*targets.shape[:-1], 1), ignore_index)
    return torch.cat([targets, pad], dim=-1)


def shard_micro_batch(
    micro_batch: Mapping[str, Any], rank: int, size: int, ignore_index: int = IGNORE_INDEX
) -> dict[str, Any]:
    """Rank `rank` of `size`'s contiguous slice of `micro_batch` (sequence dim last of input_ids):
    `input_ids`, `shift_labels` (the global next-token targets, `loss_mask` applied) and
    `position_ids` (global; `arange` when absent) sliced; `labels` and `loss_mask` dropped; a 4-D
    `attention_mask` kept whole, a 2-D one sliced; other keys passed through. The sequence length
    must divide by `size` (ValueError naming --parallel.cp-size)."""
    input_ids = micro_batch["input_ids"]
    length = input_ids.size(-1)
    if length % size:
        raise ValueError(f"--parallel.cp-size {size} must divide the sequence length, got {length} tokens")
    part = length // size
    window = slice(rank * part, (rank + 1) * part)
    positions = micro_batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    local = {k: v for k, v in micro_batch.items() if k not in ("labels", "loss_mask", *_SLICED)}
    local["input_ids"] = input_ids[..., window]
    local["position_ids"] = positions[..., window]
    local["shift_labels"] = _full_targets(micro_batch, ignore_index)[..., window]
    mask = micro_batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        local["attention_mask"] = mask[..., window]
    return local


# ----------------------------------------------------------------------------- Ulysses all-to-alls


def _all_to_all(send: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; the result's chunk j came from rank j. torch's functional
    collective, which carries autograd (the backward is the same exchange)."""
    return funcol.wait_tensor(funcol.all_to_all_single(send, None, None, group))


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, S/cp, D] (this rank's tokens, every head) -> [B, H/cp, S, D] (every token, this rank's
    heads: rank r gets heads [r H/cp, (r+1) H/cp)), over the cp `group`; differentiable."""
    return to_heads(x, dist.get_world_size(group), lambda send: _all_to_all(send, group))


def heads_to_seq(y: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [B, H/cp, S, D] -> [B, H, S/cp, D]."""
    return to_seq(y, dist.get_world_size(group), lambda send: _all_to_all(send, group))


def to_heads(x: torch.Tensor, size: int, exchange: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`seq_to_heads` over `size` ranks with `exchange(send) -> received` as the all-to-all (a plain
    function of the layout, so a test can exchange between simulated ranks)."""
    batch, heads, part, dim = x.shape
    if heads % size:
        raise ValueError(f"--parallel.cp-size {size} must divide the attention heads, got {heads}")
    send = x.reshape(batch, size, heads // size, part, dim).transpose(0, 1).contiguous()
    received = exchange(send)  # [cp, B, H/cp, S/cp, D]: dim 0 is the sender = the sequence slice
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * part, dim)


def to_seq(y: torch.Tensor, size: int, exchange: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`heads_to_seq` over `size` ranks with `exchange` as the all-to-all (see `to_heads`)."""
    batch, local_heads, length, dim = y.shape
    part = length // size
    send = y.reshape(batch, local_heads, size, part, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = exchange(send)  # [cp, B, H/cp, S/cp, D]: dim 0 is the sender = the head group
    return received.transpose(0, 1).reshape(batch, size * local_heads, part, dim)


def _local_heads(mask: torch.Tensor | None, group: Any) -> torch.Tensor | None:
    """A mask with a head dim keeps this rank's heads; a broadcast one (size 1) stays as it is."""
    if mask is None or mask.dim() < 4 or mask.size(-3) == 1:
        return mask
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = mask.size(-3) // size
    return mask[..., rank * per_rank : (rank + 1) * per_rank, :, :]


def ulysses_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    group: Any,
    **options: Any,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` of [B, H, S/cp, D] slices as if over the whole sequence: the
    all-to-all to [B, H/cp, S, D], attention (`attn_mask` must be the whole sequence's [.., S, S]),
    the all-to-all back. `options` are sdpa's keyword-only ones (`scale`, `enable_gqa`), passed on.
    Key/value heads (grouped-query attention) must divide by cp too."""
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    mask = _local_heads(attn_mask, group)
    if mask is not None and mask.size(-1) != k.size(-2):
        raise ValueError(
            f"context parallelism needs the whole sequence's attention mask ({k.size(-2)} keys), got "
            f"one over {mask.size(-1)}"
        )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, **options
    )
    return heads_to_seq(out, group)


class _UlyssesMode(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `ulysses_sdpa` and lets every other call through.
    A class because torch's function modes are (the model's attention code stays untouched)."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's protocol)
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return ulysses_sdpa(*args, group=self.group, **kwargs)
        return func(*args, **kwargs)


_ACTIVE = threading.local()  # a cp context already entered on this thread: nested entries are no-ops


@contextlib.contextmanager
def _once(make: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    if getattr(_ACTIVE, "on", False):
        yield
        return
    _ACTIVE.on = True
    try:
        with make():
            yield
    finally:
        _ACTIVE.on = False


def ulysses_attention(group: Any) -> contextlib.AbstractContextManager:
    """The context in which every `F.scaled_dot_product_attention` call is Ulysses attention over
    `group` (entering it again inside is a no-op, so attention is never split twice)."""
    return _once(lambda: _UlyssesMode(group))


# ----------------------------------------------------------------------------- ring (torch's)


def _ring_shard(mesh: Any, ignore_index: int = IGNORE_INDEX) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """Shard a micro-batch like torch's `context_parallel` does (its head-tail load balancer for causal
    attention), the targets and positions taken globally first (see `shard_micro_batch`)."""
    # torch's private (prototype) module: imported only when the ring style is asked for.
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _context_parallel_buffers,
        _create_default_load_balancer,
    )

    def shard(micro_batch: Mapping[str, Any]) -> dict[str, Any]:
        mask = micro_batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            raise ValueError("--parallel.cp-style ring supports causal attention only: use ulysses for document masks")
        whole = shard_micro_batch(micro_batch, 0, 1, ignore_index)
        buffers = [whole[key].contiguous() for key in _SLICED]
        balancer = _create_default_load_balancer(buffers[0].size(-1), mesh.size(), buffers[0].device)
        shards = _context_parallel_buffers(mesh, buffers, [buffers[0].dim() - 1] * len(buffers), balancer)
        whole.update(zip(_SLICED, shards, strict=True))
        whole.pop("attention_mask", None)
        return whole

    return shard


@contextlib.contextmanager
def _torch_ring_dispatcher(mesh: Any) -> Iterator[None]:
    """torch's SDPA-to-ring-attention dispatcher (what `context_parallel` enables around its body,
    without its buffer sharding, which `_ring_shard` did): forward and backward must run inside."""
    # torch's private (prototype) module, as above; `context_parallel` itself would reshard buffers in place.
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    previous = cp._cp_options.enable_load_balance
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
    cp._cp_options.enable_load_balance = True
    cp._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    try:
        yield
    finally:
        cp._disable_context_parallel_dispatcher_impl()
        cp._cp_options.enable_load_balance = previous


# ----------------------------------------------------------------------------- the step's parts


class CPOutput(NamedTuple):
    """What the cp forward returns: the model's output on this rank's slice and that slice (the loss
    needs the slice's targets)."""

    output: Any
    local: dict[str, Any]


class CPParts(NamedTuple):
    """The forward, training loss, evaluation loss and the context around forward + backward."""

    forward: Callable[[Any, Mapping[str, Any]], CPOutput]
    train_loss: Callable[[Any, Mapping[str, Any]], torch.Tensor]
    eval_loss: Callable[[Any, Mapping[str, Any]], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager]


def context_parallel_parts(
    forward: Callable[[Any, Mapping[str, Any]], Any],
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    *,
    mesh: Any,
    style: str = "ulysses",
    ignore_index: int = IGNORE_INDEX,
) -> CPParts:
    """The recipe's `forward` and token-mean `loss_fn` under context parallelism over `mesh` (the
    runtime mesh's 1-D "cp" sub-mesh). Training gives the step `train_loss` (this rank's part of the
    micro-batch's token mean, x cp: see the module docstring), with `dp_size` = dp x cp and the
    (dp x cp) group; evaluation gets `eval_loss` (the whole micro-batch's mean on every cp rank).
    `context` must wrap forward, loss and backward (the step's `loss_context`)."""
    if style not in CP_STYLES:
        raise ValueError(f"--parallel.cp-style must be one of {', '.join(CP_STYLES)}, got {style!r}")
    group, rank, size = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    if style == "ulysses":
        shard = functools.partial(shard_micro_batch, rank=rank, size=size, ignore_index=ignore_index)
        context = functools.partial(ulysses_attention, group)
    else:
        shard = _ring_shard(mesh, ignore_index)
        context = functools.partial(_once, functools.partial(_torch_ring_dispatcher, mesh))

    def cp_forward(model: Any, micro_batch: Mapping[str, Any]) -> CPOutput:
        local = shard(micro_batch)
        with context():
            return CPOutput(forward(model, local), local)

    def share(output: CPOutput, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        local_tokens = count_loss_tokens(output.local, ignore_index)
        all_tokens = count_loss_tokens(micro_batch, ignore_index).clamp(min=1)
        return loss_fn(output.output, output.local) * (local_tokens / all_tokens)

    def train_loss(output: CPOutput, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        return share(output, micro_batch) * size

    def eval_loss(output: CPOutput, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        whole = share(output, micro_batch).detach().clone()
        dist.all_reduce(whole, group=group)  # evaluation runs under no_grad: a plain sum over cp ranks
        return whole

    return CPParts(cp_forward, train_loss, eval_loss, context)
