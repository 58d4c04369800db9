"""The bytes one transformer block keeps for backward, per micro-batch: `layer_activation_bytes(layer)`.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), section 4: per layer and micro-batch, in bytes with 16-bit activations,
s*b*h*(34 + 5*a*s/h); with tensor parallelism t, s*b*h*(10 + 24/t + 5*a*s/(h*t)); with sequence
parallelism everything / t; with full recomputation 2*s*b*h (the block input, counted by the caller,
`fntrain.plan.estimate`). Here those terms are itemised and generalised to grouped KV heads, any MLP
width, gated (SwiGLU) MLPs, no dropout, fused attention (flash / memory-efficient SDPA keep no s x s
scores, only a log-sum-exp) and fp32 activations; with i = 4h, kv = a, dropout and unfused attention
it is exactly the paper's 34 s*b*h + 5 a*s^2*b. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LayerShape", "layer_activation_bytes"]


@dataclass(frozen=True)
class LayerShape:
    """What one transformer block computes for one micro-batch: its shape and the kernels it runs.
    The defaults (kv = heads, intermediate = 4 * hidden, dropout, unfused attention, 16-bit) are the
    paper's block."""

    seq_len: int
    micro_batch_size: int
    hidden: int
    heads: int
    kv_heads: int | None = None
    """Grouped-query attention's KV heads (None: as many as `heads`)."""
    intermediate: int | None = None
    """The MLP's width (None: 4 * hidden)."""
    gated_mlp: bool = False
    """SwiGLU (gate, up, down) rather than two linears around a GELU."""
    flash_attention: bool = False
    """Fused attention (flash / memory-efficient SDPA): no s x s scores kept for backward."""
    dropout: bool = True
    """Dropout is on (a 1-byte mask per dropout)."""
    bytes_per_value: int = 2
    """Bytes of one activation value: 2 under bf16/fp16, 4 in fp32."""


def layer_activation_bytes(layer: LayerShape, *, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes one transformer block of shape `layer` keeps for backward for one micro-batch on one of
    `tp_size` tensor-parallel ranks (Korthikanti et al. 2022, section 4.1, itemised; see the module
    doc). The defaults give the paper's s*b*h*(10 + 24/t + 5*a*s/(h*t))."""
    e, s, b, h = layer.bytes_per_value, layer.seq_len, layer.micro_batch_size, layer.hidden
    kv_width = h * (layer.kv_heads or layer.heads) // layer.heads
    width = layer.intermediate or 4 * h
    sbh = s * b * h
    # Kept whole on every tp rank unless sequence-parallel: both norms' inputs, the attention and MLP
    # inputs (the first linears' inputs) and the two residual dropout masks (1 byte each).
    replicated = 2 * e * sbh + e * sbh + e * sbh + (2 * sbh if layer.dropout else 0)
    # Split over tp by heads / MLP columns: Q, K, V, the output projection's input, the MLP.
    sharded = e * sbh + 2 * e * s * b * kv_width + e * sbh
    if layer.flash_attention:
        sharded += 4 * layer.heads * s * b  # the fp32 log-sum-exp per head and token
    else:
        scores = layer.heads * s * s * b
        sharded += e * scores + ((1 + e) * scores if layer.dropout else 0)  # softmax; dropout mask and output
    # GELU MLP: the activation's input and the second linear's input; SwiGLU: gate output, its SiLU,
    # up output and the product (the down projection's input).
    sharded += (4 if layer.gated_mlp else 2) * e * s * b * width
    replicated_share = math.ceil(replicated / tp_size) if sequence_parallel else replicated
    return replicated_share + math.ceil(sharded / tp_size)
