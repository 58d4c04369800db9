"""The per-rank memory tables of docs/distributed.md: `memory_table(model, layouts, batch_for)` renders
`fntrain.plan.estimate.estimate_memory` for a list of layouts as markdown, and `doc_tables(config,
model_factory)` gives the doc's two tables (a recipe's tiny GPT counted on the meta device, Llama-3-8B
from its config numbers). Torch is imported only inside `doc_tables`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fntrain.plan.estimate import (
    BatchShape,
    ModelLayout,
    ParallelLayout,
    estimate_memory,
    format_bytes,
    llama_layout,
)
from fntrain.plan.memory import layout_from_module

__all__ = ["LLAMA3_8B", "layout_label", "memory_table", "doc_tables"]


def layout_label(parallel: ParallelLayout) -> str:
    """A layout in words: "fsdp2 pp 2 x dp 2 x tp 2, 1f1b, AC"."""
    dims = [("pp", parallel.pp_size), ("dp", parallel.dp_size), ("cp", parallel.cp_size), ("tp", parallel.tp_size)]
    text = " x ".join(f"{name} {size}" for name, size in dims if size > 1 or name == "dp")
    if parallel.replicate > 1:
        text = text.replace(
            f"dp {parallel.dp_size}", f"dp {parallel.replicate}x{parallel.dp_size // parallel.replicate}"
        )
    strategy = "hsdp" if parallel.strategy == "fsdp2" and parallel.replicate > 1 else parallel.strategy
    extras = [parallel.pp_schedule] if parallel.pp_size > 1 else []
    extras += ["AC"] if parallel.activation_checkpointing else []
    return ", ".join([f"{strategy} {text}", *extras])


_COLUMNS = ("layout", "params/rank", "weights", "grads", "AdamW", "transient", "activations", "total")


def memory_table(model: ModelLayout, layouts: Iterable[ParallelLayout], batch_for: Any) -> str:
    """A markdown table of `estimate_memory` for each layout: `batch_for(parallel)` gives its
    `BatchShape` (the micro-batches per step depend on dp). Columns: weights (fp32), gradients,
    AdamW state, transient weight copies, activations, total, for the worst pipeline stage."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for parallel in layouts:
        worst = estimate_memory(model, parallel, batch_for(parallel))
        stage = f" (stage {worst.stage})" if parallel.pp_size > 1 else ""
        cells = [
            f"{layout_label(parallel)}{stage}",
            f"{worst.params_per_rank:,}",
            *map(format_bytes, (worst.parameters, worst.gradients, worst.optimizer_state,
                                worst.transient_weights, worst.activations, worst.total)),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LLAMA3_8B = dict(vocab_size=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8)
_TINY_LAYOUTS = (  # world, strategy, tp, pp, extras
    (1, "none", 1, 1, {}),
    (2, "ddp", 1, 1, {}),
    (2, "fsdp2", 1, 1, {}),
    (2, "none", 2, 1, {}),
    (2, "none", 1, 2, {"pp_schedule": "gpipe"}),
    (2, "none", 1, 2, {}),
    (4, "fsdp2", 2, 1, {}),
    (4, "none", 2, 2, {}),
)
_LLAMA_LAYOUTS = (
    (8, "ddp", 1, 1, {}),
    (8, "fsdp2", 1, 1, {}),
    (8, "fsdp2", 1, 1, {"activation_checkpointing": True}),
    (8, "fsdp2", 2, 1, {}),
    (8, "none", 8, 1, {}),
    (8, "fsdp2", 2, 2, {}),
    (64, "fsdp2", 1, 1, {}),
    (64, "fsdp2", 1, 1, {"replicate": 8}),
    (64, "fsdp2", 1, 1, {"replicate": 8, "activation_checkpointing": True}),
    (64, "fsdp2", 8, 1, {}),
    (64, "fsdp2", 4, 2, {}),
    (64, "fsdp2", 4, 2, {"pp_schedule": "gpipe"}),
    (64, "fsdp2", 8, 4, {"activation_checkpointing": True}),
)


def _layouts(rows: Any, mixed_precision: str) -> list[ParallelLayout]:
    return [
        ParallelLayout(
            world_size=world,
            strategy=strategy,
            tp_size=tp,
            pp_size=pp,
            mixed_precision=mixed_precision,
            **extras,
        )
        for world, strategy, tp, pp, extras in rows
    ]


def doc_tables(tiny_config: Any, model_factory: Callable[[Any], Any]) -> str:
    """The per-rank memory tables of docs/distributed.md, as markdown: the tiny GPT counted from its
    spec's `model_factory(tiny_config)` on meta (a recipe's defaults), Llama-3-8B from `llama_layout`."""
    import torch

    with torch.device("meta"):
        tiny = layout_from_module(model_factory(tiny_config))
    train = tiny_config.train

    def tiny_batch(parallel: ParallelLayout) -> BatchShape:
        per_step = train.global_batch_size // (train.micro_batch_size * parallel.dp_size)
        return BatchShape(train.micro_batch_size, tiny_config.model.context, per_step)

    llama = llama_layout(**LLAMA3_8B)
    return "\n".join([
        f"Tiny GPT defaults ({tiny.total_params:,} parameters; fp32; micro-batch {train.micro_batch_size} x "
        f"{tiny_config.model.context} tokens, global batch {train.global_batch_size}):",
        "",
        memory_table(tiny, _layouts(_TINY_LAYOUTS, "fp32"), tiny_batch),
        "",
        f"Llama-3-8B shape ({llama.total_params:,} parameters; bf16 compute, fp32 master weights; "
        "micro-batch 1 x 8192 tokens, 8 micro-batches per step):",
        "",
        memory_table(llama, _layouts(_LLAMA_LAYOUTS, "bf16"), lambda parallel: BatchShape(1, 8192, 8)),
    ])  # fmt: skip
