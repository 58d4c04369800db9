"""From torch models and job configs to `fntrain.plan.estimate`'s inputs: the torch side of it.

`layout_from_module(model)` counts a model's parameters by part (embedding, each block, head; split by
what tensor parallelism shards) on any device, meta included. `plan_memory(config, model_factory,
world_size)` builds the bare model on the meta device and returns the plan's "memory per rank" section.
The tables of docs/distributed.md are `fntrain.plan.tables`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fntrain.plan.estimate import BatchShape, ModelLayout, ParallelLayout, PartParams, estimate_stages

__all__ = ["layout_from_module", "plan_memory"]

_SHAPE_NAMES = {
    "vocab_size": ("vocab_size",),
    "hidden": ("hidden_size", "d_model", "n_embd"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads"),
    "intermediate": ("intermediate_size", "n_inner", "d_ff"),
}


def tp_sharded(module: Any, name: str) -> bool:
    """The default split: the weights of Linear and Embedding layers are sharded over tp; norms and
    biases stay whole (a column-wise bias is in fact sharded: counted whole, a slight overestimate)."""
    from torch import nn

    return name == "weight" and isinstance(module, (nn.Linear, nn.Embedding))


def layout_from_module(model: Any, *, sharded: Callable[[Any, str], bool] = tp_sharded) -> ModelLayout:
    """The exact `ModelLayout` of a decoder-only `model`: parameters registered before its first block
    (`fntrain.runtime.parallel.transformer_blocks`) are the embedding part, those after its last the
    head part; a parameter in both (a tied embedding) is `tied`. Shape numbers come from `model.config`
    or `model.cfg` (Hugging Face / nanoGPT names), else from the first embedding's weight."""
    from fntrain.runtime.parallel import transformer_blocks

    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no transformer blocks to count")
    block_of = {id(sub): index for index, block in enumerate(blocks) for sub in block.modules()}
    parts: dict[Any, dict[int, int]] = {}  # part -> {id(param): numel}, per split kind
    seen_blocks = False
    where: dict[str, Any] = {}
    for module in model.modules():
        index = block_of.get(id(module))
        if index is not None:
            seen_blocks, part = True, index
        else:
            part = "head" if seen_blocks else "embedding"
        for name, param in module.named_parameters(recurse=False):
            kind = "sharded" if sharded(module, name) else "replicated"
            if isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "ep_group"):
                kind = "experts"  # fntrain.runtime.expert_parallel's protocol: experts on dim 0
            parts.setdefault((part, kind), {})[id(param)] = param.numel()
            where.setdefault(id(param), set()).add(part)

    def count(part: Any) -> PartParams:
        return PartParams(*(sum(parts.get((part, kind), {}).values()) for kind in ("sharded", "replicated", "experts")))

    tied = PartParams(*(
        sum(n for pid, n in parts.get(("head", kind), {}).items() if "embedding" in where[pid])
        for kind in ("sharded", "replicated")
    ))  # fmt: skip
    return ModelLayout(
        **_shape_numbers(model),
        embedding=count("embedding"),
        blocks=tuple(count(index) for index in range(len(blocks))),
        head=count("head"),
        tied=tied,
        gated_mlp=any("gate" in name for name, _ in blocks[0].named_parameters()),
    )


def _shape_numbers(model: Any) -> dict[str, int]:
    from torch import nn

    sources = [s for s in (getattr(model, "config", None), getattr(model, "cfg", None)) if s is not None]
    found: dict[str, int] = {}
    for key, names in _SHAPE_NAMES.items():
        for source in sources:
            value = next(
                (getattr(source, n) for n in names if isinstance(getattr(source, n, None), int)), None
            )
            if value is not None:
                found[key] = value
                break
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        found.setdefault("vocab_size", embedding.num_embeddings)
        found.setdefault("hidden", embedding.embedding_dim)
    if "hidden" not in found or "vocab_size" not in found:
        raise ValueError(f"cannot tell the hidden size and vocabulary of {type(model).__name__}")
    found.setdefault("heads", max(1, found["hidden"] // 64))
    found.setdefault("kv_heads", found["heads"])
    found.setdefault("intermediate", 4 * found["hidden"])
    return found


def parallel_layout(parallel: Any, world_size: int) -> ParallelLayout:
    """The `ParallelLayout` of a `ParallelConfig` over `world_size` ranks (sequence parallelism off)."""
    return ParallelLayout(
        world_size=world_size,
        strategy=parallel.strategy,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        ep_size=getattr(parallel, "ep_size", 1),
        replicate=parallel.replicate,
        mixed_precision=parallel.mixed_precision,
        activation_checkpointing=parallel.activation_checkpointing,
        reshard_after_forward=parallel.reshard_after_forward,
        pp_schedule=getattr(parallel, "pp_schedule", "1f1b"),
        loss_parallel=getattr(parallel, "loss_parallel", True),
        cp_size=getattr(parallel, "cp_size", 1),
    )


def _sequence_length(config: Any) -> int | None:
    for section, name in (
        ("model", "context"),
        ("data", "max_length"),
        ("data", "seq_len"),
        ("model", "max_length"),
    ):
        value = getattr(getattr(config, section, None), name, None)
        if type(value) is int and value > 0:
            return value
    return None


def plan_memory(
    config: Any, model_factory: Callable[[Any], Any], world_size: int, objective: Any = None
) -> dict[str, Any]:
    """The plan's "memory per rank" section: `model_factory(config)` built on the meta device (no
    weights), counted, and estimated for `config.parallel` over `world_size` ranks with the config's
    micro-batch and sequence length (`model.context` or `data.max_length`; none found: activations 0,
    said in a note). Byte counts are ints; the worst pipeline stage's, plus every stage's total.
    `objective` (a recipe's `ObjectiveSpec`, or None): its `frozen_model(config)` (a DPO reference, a KD
    teacher; None when it loads none) is a model without gradients or optimizer state, sharded like the
    trained one, whose weights per rank ("frozen_weights") join the total; the activations are those of
    its `rows_per_sample` rows per sample (a preference pair is two)."""
    import torch

    with torch.device("meta"):
        model = model_factory(config)
        frozen_model = getattr(objective, "frozen_model", None)
        frozen = frozen_model(config) if frozen_model is not None else None
    model_layout = layout_from_module(model)
    parallel = parallel_layout(config.parallel, world_size)
    seq_len = _sequence_length(config)
    train = config.train
    micro_batches = max(1, train.global_batch_size // (train.micro_batch_size * parallel.dp_size))
    attn = getattr(getattr(config, "model", None), "attn_implementation", None)
    dropout = getattr(getattr(config, "model", None), "dropout", 0.0)
    batch = BatchShape(
        micro_batch_size=train.micro_batch_size * getattr(objective, "rows_per_sample", 1),
        seq_len=seq_len or 0,
        micro_batches=micro_batches,
        flash_attention=attn != "eager",
        dropout=isinstance(dropout, float) and dropout > 0,
    )
    stages = estimate_stages(model_layout, parallel, batch)
    worst = max(stages, key=lambda estimate: estimate.total)
    section: dict[str, Any] = {
        "model_params": model_layout.total_params,
        "params_per_rank": worst.params_per_rank,
        "stage": worst.stage,
        "stages": len(stages),
        **{name: getattr(worst, name) for name in
           ("parameters", "gradients", "optimizer_state", "transient_weights", "activations", "total")},
        "stage_totals": [estimate.total for estimate in stages],
        "seq_len": seq_len,
        "micro_batch_size": train.micro_batch_size,
        "mixed_precision": parallel.mixed_precision,
    }  # fmt: skip
    if frozen is not None:  # its weights as the trained model's are held, nothing else
        frozen_stage = max(estimate_stages(layout_from_module(frozen), parallel, batch), key=lambda e: e.parameters)
        section.update(frozen_params=layout_from_module(frozen).total_params, frozen_weights=frozen_stage.parameters,
                       total=section["total"] + frozen_stage.parameters)  # fmt: skip
    if seq_len is None:
        section["notes"] = ["activations not estimated: the config names no sequence length"]
    return section
