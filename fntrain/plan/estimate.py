"""Per-rank training memory of a decoder-only transformer under none / DDP / FSDP2 (HSDP) x TP x PP.

`estimate_memory(model, parallel, batch)` is arithmetic on three frozen inputs and returns the bytes one
rank of the worst pipeline stage holds: parameters, gradients, optimizer state, transient weight copies
and activations. Nothing here imports torch: `fntrain.plan.memory` counts a torch model into a
`ModelLayout` exactly, and `llama_layout` does it for Llama-shaped numbers (tested equal to
transformers' model). `fntrain.plan.tables.doc_tables` prints the tables of docs/distributed.md.

What is assumed (the torch machinery fntrain uses, `fntrain.runtime.parallel`):
- Parameters are stored in fp32 whatever the compute dtype: autocast under none/ddp, and FSDP2's
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` keeps the sharded fp32 master weights and
  gathers bf16 copies per block. Gradients are fp32 (FSDP2 reduce-scatters into fp32 shards).
- AdamW holds two fp32 states (exp_avg, exp_avg_sq) per parameter it owns.
- DDP (gradient_as_bucket_view off, torch's default) keeps a second fp32 copy of the gradients in its
  all-reduce buckets.
- FSDP2 shards over dp (HSDP: over dp_shard only; replicas hold the same shard). The root module's
  weights (embeddings, final norm, head) stay gathered from forward to backward (FSDP2 does not reshard
  the root after forward); so does the last block (fntrain does not reshard it); with
  `reshard_after_forward` the current and the prefetched block are gathered too, otherwise every block.
  Under none/ddp with bf16/fp16, autocast caches a low-precision copy of every weight during forward.
- TP shards every `PartParams.sharded` parameter over tp (attention q/k/v/o, MLP, embedding, head) and
  keeps `replicated` ones (norms, biases) whole; PP puts the blocks evenly on the stages, the parts
  before them on the first stage and the parts after them on the last (a tied embedding on both).
- Activations: Korthikanti et al. 2022, section 4, per block and micro-batch
  (`fntrain.plan.activations.layer_activation_bytes`); with full recomputation only the block input,
  2*s*b*h, plus one block rebuilt in backward. Logits: the last stage keeps the compute-dtype logits
  and the fp32 log-softmax of the loss (vocabulary-sharded over tp with loss parallelism). In flight
  per stage: one micro-batch without PP, min(micro-batches, pp - stage) with 1F1B, every micro-batch
  with GPipe (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters").
- Not counted: the embedding output and final-norm input (O(s*b*h), once), communication buffers,
  the CUDA context and allocator fragmentation (budget 10-20% on top).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from fntrain.plan.activations import LayerShape, layer_activation_bytes

__all__ = [
    "PartParams",
    "ModelLayout",
    "ParallelLayout",
    "BatchShape",
    "MemoryEstimate",
    "estimate_memory",
    "estimate_stages",
    "llama_layout",
    "stage_blocks",
    "format_bytes",
]

STRATEGIES = ("none", "ddp", "fsdp2")
SCHEDULES = ("gpipe", "1f1b")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_MASTER_BYTES = 4  # fp32 parameters, gradients and AdamW states, whatever the compute dtype
_ADAMW_STATES = 2


@dataclass(frozen=True)
class PartParams:
    """Parameter counts of one part of the model, split by what tensor parallelism does to them."""

    sharded: int = 0
    """Split over the tp ranks (the weights of attention, MLP, embedding and head)."""
    replicated: int = 0
    """Whole on every tp rank (norms, biases)."""
    experts: int = 0
    """The routed experts' weights of MoE layers: split over the ep ranks, whole over tp."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts

    def __add__(self, other: PartParams) -> PartParams:
        return PartParams(self.sharded + other.sharded, self.replicated + other.replicated, self.experts + other.experts)

    def per_tp_rank(self, tp_size: int) -> int:
        """Parameters one tp rank holds (a sharded tensor's remainder rounds up)."""
        return math.ceil(self.sharded / tp_size) + self.replicated + self.experts

    def per_rank(self, tp_size: int, ep_size: int) -> int:
        """Parameters one rank computes with: its tp share and its ep share of the experts."""
        return math.ceil(self.sharded / tp_size) + self.replicated + math.ceil(self.experts / ep_size)


@dataclass(frozen=True)
class ModelLayout:
    """A decoder-only transformer's shape and its exact parameter counts by part."""

    vocab_size: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    embedding: PartParams
    """The parameters before the blocks (token and position embeddings): the first pipeline stage's."""
    blocks: tuple[PartParams, ...]
    """One entry per transformer block, in order."""
    head: PartParams
    """The parameters after the blocks (final norm, output head; a tied head's weight counted here too)."""
    tied: PartParams = PartParams()
    """Parameters the embedding and the head share (none: untied); held once where both parts are."""
    gated_mlp: bool = False
    """The MLP is gated (SwiGLU: gate, up, down) rather than two linears around a GELU."""

    @property
    def layers(self) -> int:
        return len(self.blocks)

    @property
    def total_params(self) -> int:
        """Unique parameters: what sum(p.numel() for p in model.parameters()) gives."""
        return self.embedding.total + sum(b.total for b in self.blocks) + self.head.total - self.tied.total


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks split the model: strategy over dp, tp and pp degrees, precision and schedule."""

    world_size: int = 1
    strategy: str = "none"
    """none (one process per model replica, no data parallelism), ddp or fsdp2."""
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    """fsdp2 only: the routed experts split over ep of the dp ranks, FSDP2 sharding them over the rest."""
    replicate: int = 1
    """fsdp2 only: HSDP replica groups; parameters are sharded over dp / replicate ranks."""
    mixed_precision: str = "bf16"
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    loss_parallel: bool = True
    """With tp > 1, the logits and the loss stay vocabulary-sharded."""
    sequence_parallel: bool = False
    """With tp > 1, norms and dropout run sequence-sharded (their activations / tp)."""
    cp_size: int = 1
    """Context parallelism: each sequence split over cp ranks (Ulysses: every activation / cp, the
    attention scores too, which are split by heads); parameters are sharded over dp x cp under fsdp2."""

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size * self.cp_size)

    @property
    def shard_size(self) -> int:
        """The ranks one parameter is sharded over: dp x cp (dp / replicate under HSDP) for fsdp2, else 1."""
        return self.dp_size * self.cp_size // self.replicate if self.strategy == "fsdp2" else 1

    def validate(self, layers: int) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"parallel.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.mixed_precision not in _DTYPE_BYTES:
            raise ValueError(
                f"parallel.mixed_precision must be one of {tuple(_DTYPE_BYTES)}, got {self.mixed_precision!r}"
            )
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule must be one of {SCHEDULES}, got {self.pp_schedule!r}")
        model_parallel = self.tp_size * self.pp_size * self.cp_size
        if min(self.tp_size, self.pp_size, self.cp_size, self.replicate) < 1 or self.world_size % model_parallel:
            raise ValueError(
                f"world size {self.world_size} must be divisible by parallel.tp_size x pp_size x cp_size "
                f"= {model_parallel}"
            )
        if self.dp_size % self.replicate:
            raise ValueError(
                f"parallel.replicate ({self.replicate}) must divide the data-parallel size ({self.dp_size})"
            )
        if self.strategy == "none" and self.dp_size * self.cp_size > 1:
            raise ValueError(f"parallel.strategy 'none' needs data-parallel size 1, got {self.dp_size}")
        if self.ep_size < 1 or self.dp_size % self.ep_size:
            raise ValueError(f"parallel.ep_size ({self.ep_size}) must divide the data-parallel size ({self.dp_size})")
        if self.pp_size > layers:
            raise ValueError(f"parallel.pp_size ({self.pp_size}) must not exceed the model's {layers} blocks")


@dataclass(frozen=True)
class BatchShape:
    """What one rank computes per micro-batch, and how many micro-batches make a step."""

    micro_batch_size: int
    seq_len: int
    micro_batches: int = 1
    flash_attention: bool = True
    """Fused attention (flash / memory-efficient SDPA): no s x s scores kept for backward."""
    dropout: bool = False
    """Dropout is on (a 1-byte mask per dropout)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak (the worst pipeline stage's rank when pp > 1)."""

    stage: int
    params_per_rank: int
    """Parameters this rank owns (after tp, pp and FSDP sharding)."""
    parameters: int
    gradients: int
    optimizer_state: int
    transient_weights: int
    """Weight copies alive during forward/backward: FSDP2's gathered blocks, autocast's cast cache."""
    activations: int
    parts: Mapping[str, int] = field(default_factory=dict)
    """Activations itemised: "layers" (stored by the blocks), "recompute" (one block rebuilt in
    backward under checkpointing), "logits"."""

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.transient_weights
            + self.activations
        )


def stage_blocks(layers: int, pp_size: int) -> list[range]:
    """The block indices of each pipeline stage: as even as possible, earlier stages one more."""
    per, extra = divmod(layers, pp_size)
    bounds = [0]
    for stage in range(pp_size):
        bounds.append(bounds[-1] + per + (1 if stage < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(pp_size)]


def _in_flight(parallel: ParallelLayout, micro_batches: int, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if parallel.pp_size == 1:
        return 1  # gradient accumulation runs each micro-batch's backward before the next forward
    if parallel.pp_schedule == "gpipe":
        return micro_batches  # every forward before any backward
    return min(micro_batches, parallel.pp_size - stage)  # 1F1B: the warm-up depth of the stage


def _stage_activations(
    model: ModelLayout, parallel: ParallelLayout, batch: BatchShape, stage: int, layers: int
) -> dict[str, int]:
    e = _DTYPE_BYTES[parallel.mixed_precision]
    t = parallel.tp_size
    layer = LayerShape(
        batch.seq_len, batch.micro_batch_size, model.hidden, model.heads, kv_heads=model.kv_heads,
        intermediate=model.intermediate, gated_mlp=model.gated_mlp, flash_attention=batch.flash_attention,
        dropout=batch.dropout, bytes_per_value=e,
    )  # fmt: skip
    full_layer = layer_activation_bytes(layer, tp_size=t, sequence_parallel=parallel.sequence_parallel)
    # Ulysses: per-token activations hold seq/cp tokens, attention's seq x seq scores heads/cp heads.
    full_layer = math.ceil(full_layer / parallel.cp_size)
    in_flight = _in_flight(parallel, batch.micro_batches, stage)
    tokens = math.ceil(batch.seq_len * batch.micro_batch_size / parallel.cp_size)
    parts = {"layers": 0, "recompute": 0, "logits": 0}
    if parallel.activation_checkpointing:
        block_input = e * tokens * model.hidden
        block_input = math.ceil(block_input / t) if parallel.sequence_parallel else block_input
        parts["layers"] = in_flight * layers * block_input
        parts["recompute"] = full_layer if layers else 0  # one block rebuilt at a time in backward
    else:
        parts["layers"] = in_flight * layers * full_layer
    if stage == parallel.pp_size - 1:
        vocab_split = t if parallel.loss_parallel else 1
        # The compute-dtype logits and the fp32 log-softmax the cross-entropy keeps for backward.
        parts["logits"] = in_flight * math.ceil((e + 4) * tokens * model.vocab_size / vocab_split)
    return parts


def _stage_params(
    model: ModelLayout, stage: int, pp_size: int, blocks: range
) -> tuple[PartParams, PartParams]:
    """(root, blocks) parameters of a stage before tp: root is what sits outside the blocks."""
    root = PartParams()
    if stage == 0:
        root = root + model.embedding
    if stage == pp_size - 1:
        root = root + model.head
        if pp_size == 1:  # one copy of a shared (tied) weight
            root = PartParams(root.sharded - model.tied.sharded, root.replicated - model.tied.replicated)
    block_sum = PartParams()
    for index in blocks:
        block_sum = block_sum + model.blocks[index]
    return root, block_sum


def _stage_estimate(
    model: ModelLayout, parallel: ParallelLayout, batch: BatchShape, stage: int
) -> MemoryEstimate:
    blocks = stage_blocks(model.layers, parallel.pp_size)[stage]
    root, block_sum = _stage_params(model, stage, parallel.pp_size, blocks)
    t, shards = parallel.tp_size, parallel.shard_size
    per_tp = root.per_tp_rank(t) + block_sum.per_tp_rank(t)
    owned = math.ceil(per_tp / shards)  # FSDP2 pads each shard to equal size: round up
    compute_bytes = _DTYPE_BYTES[parallel.mixed_precision]
    gradients = _MASTER_BYTES * owned
    if parallel.strategy == "ddp":
        gradients *= 2  # the reducer's buckets hold a second copy
    if parallel.strategy == "fsdp2":
        # Gathered in the compute dtype: the root's weights and the blocks not (yet) resharded.
        # A MoE block gathers only its ep rank's experts (FSDP2 shards them over dp / ep ranks).
        block_sizes = sorted((model.blocks[i].per_rank(t, parallel.ep_size) for i in blocks), reverse=True)
        gathered = min(3, len(block_sizes)) if parallel.reshard_after_forward else len(block_sizes)
        transient = compute_bytes * (root.per_tp_rank(t) + sum(block_sizes[:gathered]))
    elif compute_bytes != _MASTER_BYTES:
        transient = compute_bytes * per_tp  # autocast's cast cache: a low-precision copy of each weight
    else:
        transient = 0
    parts = _stage_activations(model, parallel, batch, stage, len(blocks))
    return MemoryEstimate(
        stage=stage,
        params_per_rank=owned,
        parameters=_MASTER_BYTES * owned,
        gradients=gradients,
        optimizer_state=_ADAMW_STATES * _MASTER_BYTES * owned,
        transient_weights=transient,
        activations=sum(parts.values()),
        parts=parts,
    )


def estimate_stages(model: ModelLayout, parallel: ParallelLayout, batch: BatchShape) -> list[MemoryEstimate]:
    """The per-rank estimate of every pipeline stage (one entry without PP). Raises `ValueError` naming
    the field when the layout does not fit the world or the model."""
    parallel.validate(model.layers)
    return [_stage_estimate(model, parallel, batch, stage) for stage in range(parallel.pp_size)]


def estimate_memory(model: ModelLayout, parallel: ParallelLayout, batch: BatchShape) -> MemoryEstimate:
    """The per-rank bytes of the stage whose ranks need the most (see the module doc for what is
    counted and assumed)."""
    return max(estimate_stages(model, parallel, batch), key=lambda estimate: estimate.total)


def llama_layout(
    *,
    vocab_size: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool = False,
) -> ModelLayout:
    """The exact layout of a Llama-family model (transformers' `LlamaForCausalLM`: no biases, RMSNorm,
    grouped KV heads, SwiGLU MLP) from its config numbers."""
    kv_width = kv_heads * (hidden // heads)
    block = PartParams(
        sharded=2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * intermediate,  # q, o; k, v; MLP
        replicated=2 * hidden,  # the two RMSNorm weights
    )
    embedding = PartParams(sharded=vocab_size * hidden)
    return ModelLayout(
        vocab_size=vocab_size, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
        embedding=embedding, blocks=(block,) * layers,
        head=PartParams(sharded=vocab_size * hidden, replicated=hidden),  # lm_head; final norm
        tied=embedding if tied else PartParams(), gated_mlp=True,
    )  # fmt: skip


def format_bytes(count: int) -> str:
    """`count` bytes in binary units: "512 B", "3.2 MiB", "41.07 GiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
