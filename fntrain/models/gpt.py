"""The tiny GPT: a nanoGPT-style decoder-only transformer, on one page.

    model = TinyGPT(ModelConfig(context=128, n_layer=4, n_head=4, d_model=128))
    logits = model(input_ids)                    # [batch, seq, vocab]

Token and position embeddings, a stack of pre-norm blocks (causal self-attention through
`F.scaled_dot_product_attention`, then a 4x GELU MLP, or a mixture of experts from `fntrain.models.moe`
with `experts > 0`), a final LayerNorm and an output head tied to the token embedding. Architecturally a
GPT-2, which is how `fntrain.models.gpt2` exports it. The parameter names (`tok`, `pos`,
`blocks.N.attn.q`, `blocks.N.mlp.0`, `head`, ...) are a file format: checkpoints, the GPT-2 export and the
tensor- and pipeline-parallel plans of recipes/tiny_gpt.py name them.

Sampling (fntrain.sampling.decode) passes a `KVCache` so each new token costs one token's forward: the
keys and values of the tokens already fed stay in preallocated buffers of `context` columns. A batch of
prompts of different lengths is fed left-padded, with each row's own positions and a mask of its real
tokens: the cache records which columns are real, and no token attends a padded one. Training never
passes a cache, and its path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fntrain.config import require_float, require_int
from fntrain.models.moe import GroupedExperts, MoE, RouterOutput, mean_aux_loss, moe_layers

__all__ = ["ModelConfig", "KVCache", "CausalSelfAttention", "Block", "TinyGPT"]


@dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape."""

    context: int = 128
    """Tokens (bytes) per sequence."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs bitwise reproducible across resumes)."""
    vocab_size: int = 256
    """Vocabulary size (bytes); with data.shards, raised to the shards' vocabulary (bytes + EOS: 257)."""
    experts: int = 0
    """Mixture of experts: routed experts per block (0: a dense MLP); tokens choose their top experts, none is dropped."""
    experts_per_token: int = 2
    """With model.experts: experts each token is routed to (top-k of the router's softmax, weights renormalised)."""
    shared_experts: int = 0
    """With model.experts: experts every token also passes through (one dense MLP of that many experts' width)."""
    expert_hidden: int = 0
    """With model.experts: hidden units of each expert's MLP (0: 4 x d_model, the dense MLP's)."""
    router_aux_loss_weight: float = 0.01
    """With model.experts: weight of the load-balancing loss (Switch/Mixtral form, 1.0 when balanced) added to the trained loss."""
    router_bias_rate: float = 0.0
    """With model.experts: DeepSeek-V3's auxiliary-loss-free balancing, the per-step update of the routing bias (0: off; e.g. 0.001)."""

    def validate(self, prefix: str = "model") -> None:
        """Value rules naming `prefix.field` (how the shape meets a parallel layout is the recipe's check)."""
        for name in ("context", "n_layer", "n_head", "d_model", "vocab_size"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=1)
        if self.d_model % self.n_head:
            raise ValueError(f"{prefix}.d_model ({self.d_model}) must be divisible by {prefix}.n_head ({self.n_head})")
        require_float(f"{prefix}.dropout", self.dropout, min=0.0, max=1.0)
        for name in ("experts", "shared_experts", "expert_hidden"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=0)
        require_int(f"{prefix}.experts_per_token", self.experts_per_token, min=1, max=self.experts or None)
        for name in ("router_aux_loss_weight", "router_bias_rate"):
            require_float(f"{prefix}.{name}", getattr(self, name), min=0.0)


@dataclass
class KVCache:
    """The keys and values of the tokens fed so far, per block, in buffers of `context` columns
    (allocated at a block's first forward, in its dtype, device and local head count). `length` is the
    number of columns filled, the column of the next token. Mutable on purpose: it is the one buffer a
    decode loop threads through `TinyGPT.forward(..., kv_cache=)`, which advances `length`. The learned
    position embedding ends at `context`: a full cache takes no more tokens (the sampler then recomputes
    the window, see fntrain.sampling.decode).

    A left-padded batch: `valid` [batch, context] records which filled columns hold real tokens (None:
    every column fed so far is real). A padded key is attended by no query but its own column's, so
    attention never sees a row with every key masked; what a padded column computes is never read."""

    context: int
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0
    valid: torch.Tensor | None = None

    @classmethod
    def empty(cls, n_layer: int, context: int) -> KVCache:
        return cls(context, [None] * n_layer, [None] * n_layer)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes this forward's k, v [batch, heads, seq, head_dim] at columns [length, length + seq) of
        `layer` and returns the keys and values of columns [0, length + seq)."""
        end = self.length + k.size(2)
        if self.keys[layer] is None:
            shape = (k.size(0), k.size(1), self.context, k.size(3))
            self.keys[layer] = k.new_empty(shape)
            self.values[layer] = v.new_empty(shape)
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def take_mask(self, real: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> None:
        """Records which of the `seq` new columns are real tokens (`real` [batch, seq], nonzero: real;
        None: all of them). Called once per forward, before the blocks extend the cache."""
        if real is None and self.valid is None:
            return
        if self.valid is None:  # the first padded forward: every column before it was real
            self.valid = torch.ones(batch, self.context, dtype=torch.bool, device=device)
        self.valid[:, self.length : self.length + seq] = True if real is None else real.bool()

    def causal_mask(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """The boolean mask of `seq` new queries over every cached key (True: may attend): [seq,
        length + seq] without padding, [batch, 1, seq, length + seq] with it (`valid`); None where plain
        causal attention (an empty cache) or none (one query) is exact."""
        end = self.length + seq
        if self.valid is None and (self.length == 0 or seq == 1):
            return None
        keys = torch.arange(end, device=device)
        queries = self.length + torch.arange(seq, device=device)
        causal = keys[None, :] <= queries[:, None]
        if self.valid is None:
            return causal
        return (causal & self.valid[:, None, None, :end]) | (keys[None, :] == queries[:, None])


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        # Separate q, k, v projections (not one fused one) so tensor parallelism can split them by head.
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        batch, seq, _ = x.shape  # under tensor parallelism q, k, v hold this rank's heads only
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        causal = attn_mask is None  # a boolean mask already holds causality (packed documents: block-diagonal)
        if kv_cache is not None:  # decoding: the new queries attend over the cached columns too, by the
            k, v = kv_cache.extend(layer, k, v)  # mask `TinyGPT._decode` built once (None: see causal_mask)
            causal = attn_mask is None and kv_cache.length == 0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)  # fmt: skip
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.experts:  # a mixture of experts instead of the MLP (fntrain.models.moe)
            self.moe = MoE(cfg.d_model, cfg.expert_hidden or 4 * cfg.d_model, cfg.experts, cfg.experts_per_token,
                           shared=cfg.shared_experts, aux_loss_weight=cfg.router_aux_loss_weight,
                           bias_rate=cfg.router_bias_rate)  # fmt: skip
            self.mlp = nn.Dropout(cfg.dropout)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model),
                nn.Dropout(cfg.dropout),
            )  # fmt: skip

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        h = self.ln1(x)
        x = x + (self.attn(h, attn_mask) if kv_cache is None else self.attn(h, attn_mask, kv_cache, layer))
        h = self.ln2(x)
        return x + self.mlp(self.moe(h) if hasattr(self, "moe") else h)


class TinyGPT(nn.Module):
    """Token + position embeddings, a stack of pre-norm blocks, a tied output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        """GPT-2's initialisation of one module (also the `post_init` of a model built on meta)."""
        if isinstance(module, GroupedExperts):
            module.reset_parameters()
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] (a MoE model: a `RouterOutput` holding them and, in training, the
        weighted router loss averaged over the blocks). Packed sequences (fntrain.data.packing) pass `position_ids` that restart
        at each document and a 4-D boolean `attention_mask` [batch, 1, seq, seq] (True: may attend) that
        keeps attention inside each document; a 2-D padding mask is ignored (attention stays causal).
        With `kv_cache` (from `new_kv_cache`) `input_ids` are the tokens after the cached ones, at positions
        `position_ids` ([batch, seq]; None: from `kv_cache.length` on) and with `attention_mask` [batch, seq]
        marking the real tokens of a left-padded batch (None: all real); the cache takes them in."""
        if kv_cache is not None:
            return self._decode(input_ids, kv_cache, position_ids, attention_mask)
        x = input_ids  # a pipeline stage after the first gets the previous stage's activations
        if self.tok is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
            x = self.drop(self.tok(input_ids) + self.pos(position_ids))
        attn_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
        # A pipeline stage holds its blocks in a ModuleDict keyed by their original index.
        for block in self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks:
            x = block(x) if attn_mask is None else block(x, attn_mask)
        x = self.head(self.ln_f(x)) if self.head is not None else x
        return RouterOutput(x, mean_aux_loss(moe_layers(self))) if self.cfg.experts else x

    def new_kv_cache(self) -> KVCache:
        """An empty cache for `forward(..., kv_cache=)`: a whole model (not a pipeline stage), any batch."""
        if isinstance(self.blocks, nn.ModuleDict) or self.tok is None or self.head is None:
            raise ValueError("a pipeline stage of the tiny GPT cannot decode with a KV cache: load the whole model")
        return KVCache.empty(len(self.blocks), self.cfg.context)

    def _decode(
        self,
        input_ids: torch.Tensor,
        kv_cache: KVCache,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward of `input_ids` [batch, seq] after the cached tokens; advances the cache."""
        start, end = kv_cache.length, kv_cache.length + input_ids.size(1)
        if end > kv_cache.context:
            raise ValueError(f"the KV cache holds {kv_cache.context} positions (model.context): {start} cached + "
                             f"{input_ids.size(1)} new do not fit")  # fmt: skip
        if position_ids is None:
            position_ids = torch.arange(start, end, device=input_ids.device)
        x = self.drop(self.tok(input_ids) + self.pos(position_ids))
        kv_cache.take_mask(attention_mask, input_ids.size(0), input_ids.size(1), input_ids.device)
        mask = kv_cache.causal_mask(input_ids.size(1), input_ids.device)
        for layer, block in enumerate(self.blocks):
            x = block(x, mask, kv_cache, layer)
        kv_cache.length = end
        x = self.head(self.ln_f(x))
        return RouterOutput(x, mean_aux_loss(moe_layers(self))) if self.cfg.experts else x
