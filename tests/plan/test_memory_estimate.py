"""Per-rank memory estimates (fntrain.plan.estimate) and the parameter counts they rest on
(fntrain.plan.memory): counts equal the real modules', the activation terms equal Korthikanti et al.
2022's formulas, sharding divides what it should, and docs/distributed.md's tables are the function's
current output."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.plan.activations import LayerShape, layer_activation_bytes
from fntrain.plan.estimate import (
    BatchShape,
    ParallelLayout,
    PartParams,
    estimate_memory,
    estimate_stages,
    llama_layout,
    stage_blocks,
)
from fntrain.plan.memory import layout_from_module, plan_memory
from fntrain.plan.tables import LLAMA3_8B, doc_tables
from fntrain.runtime.parallel import ParallelConfig
from recipes.tiny_gpt import Config, spec
from tests.helpers.waiting import run_to_end

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"


def meta(factory):
    with torch.device("meta"):
        return factory()


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def llama_of_shape(**shape):
    config = LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], tie_word_embeddings=shape.get("tied", False),
    )  # fmt: skip
    return meta(lambda: LlamaForCausalLM(config))


# ----------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize("cfg", [ModelConfig(), ModelConfig(n_layer=3, d_model=96, n_head=3, vocab_size=300)])
def test_tiny_gpt_counts_equal_its_parameters(cfg):
    model = meta(lambda: TinyGPT(cfg))
    layout = layout_from_module(model)
    assert layout.total_params == numel(model)
    assert layout.embedding.total == numel(model.tok) + numel(model.pos)
    assert [b.total for b in layout.blocks] == [numel(block) for block in model.blocks]
    assert layout.head.total == numel(model.ln_f) + model.head.weight.numel()  # the tied weight too
    assert layout.tied == PartParams(sharded=model.tok.weight.numel())
    norms = sum(numel(m) for m in model.blocks[0].modules() if isinstance(m, torch.nn.LayerNorm))
    biases = sum(m.bias.numel() for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear))
    assert layout.blocks[0].replicated == norms + biases
    assert (layout.hidden, layout.heads, layout.vocab_size) == (cfg.d_model, cfg.n_head, cfg.vocab_size)


@pytest.mark.parametrize(
    "shape",
    [
        dict(vocab_size=320, hidden=64, intermediate=176, layers=3, heads=4, kv_heads=2),
        dict(vocab_size=320, hidden=64, intermediate=176, layers=2, heads=4, kv_heads=4, tied=True),
        LLAMA3_8B,  # on meta: no memory; the doc's table rests on this count
    ],
)
def test_llama_layout_equals_transformers_model(shape):
    model = llama_of_shape(**shape)
    counted = layout_from_module(model)
    computed = llama_layout(**shape)
    assert counted == computed
    assert computed.total_params == numel(model)
    if shape is LLAMA3_8B:
        assert computed.total_params == 8_030_261_248


# ----------------------------------------------------------------------------- activations


def test_activations_are_the_papers_formulas():
    s, b, h, a = 2048, 2, 1024, 16
    sbh = s * b * h
    # Korthikanti et al. 2022, eq. 1-3 (16-bit values, dropout, unfused attention, MLP 4h).
    assert layer_activation_bytes(LayerShape(s, b, h, a)) == 34 * sbh + 5 * a * s * s * b
    for t in (2, 4, 8):
        tp = layer_activation_bytes(LayerShape(s, b, h, a), tp_size=t)
        assert tp == sbh * 10 + (24 * sbh + 5 * a * s * s * b) // t
        sp = layer_activation_bytes(LayerShape(s, b, h, a), tp_size=t, sequence_parallel=True)
        assert sp == (34 * sbh + 5 * a * s * s * b) // t
    # Fused attention keeps no s x s scores; no dropout keeps no masks.
    fused = layer_activation_bytes(LayerShape(s, b, h, a, flash_attention=True, dropout=False))
    assert fused == 32 * sbh + 4 * a * s * b


def test_checkpointing_keeps_block_inputs_and_one_block():
    model = llama_layout(**dict(LLAMA3_8B, layers=4))
    batch = BatchShape(micro_batch_size=1, seq_len=1024)
    plain = estimate_memory(model, ParallelLayout(), batch)
    checkpointed = estimate_memory(model, ParallelLayout(activation_checkpointing=True), batch)
    one_layer = plain.parts["layers"] // 4
    assert checkpointed.parts == {
        "layers": 4 * 2 * 1024 * 4096,
        "recompute": one_layer,
        "logits": plain.parts["logits"],
    }
    assert plain.parts["logits"] == (2 + 4) * 1024 * model.vocab_size


# ----------------------------------------------------------------------------- sharding


def test_strategies_divide_what_they_shard():
    model = llama_layout(**LLAMA3_8B)
    batch = BatchShape(1, 4096)
    total = model.total_params
    ddp = estimate_memory(model, ParallelLayout(8, "ddp"), batch)
    assert ddp.params_per_rank == total and ddp.gradients == 2 * 4 * total  # + the reducer's buckets
    assert ddp.optimizer_state == 8 * total and ddp.parameters == 4 * total
    fsdp = estimate_memory(model, ParallelLayout(8, "fsdp2"), batch)
    assert fsdp.params_per_rank == math.ceil(total / 8) and fsdp.optimizer_state == 8 * fsdp.params_per_rank
    assert fsdp.activations == ddp.activations  # data parallelism leaves activations alone
    hsdp = estimate_memory(model, ParallelLayout(64, "fsdp2", replicate=8), batch)
    assert hsdp.params_per_rank == fsdp.params_per_rank  # sharded over the 8 ranks of a replica
    tp = estimate_memory(model, ParallelLayout(8, "none", tp_size=8), batch)
    replicated = model.embedding.replicated + sum(b.replicated for b in model.blocks) + model.head.replicated
    sharded = total - replicated
    assert tp.params_per_rank == math.ceil(sharded / 8) + replicated
    assert tp.activations < ddp.activations


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_hold_their_parts(tied):
    model = llama_layout(**dict(LLAMA3_8B, layers=6, tied=tied))
    batch = BatchShape(1, 512, micro_batches=8)
    stages = estimate_stages(model, ParallelLayout(3, "none", pp_size=3), batch)
    assert [r for r in stage_blocks(6, 3)] == [range(0, 2), range(2, 4), range(4, 6)]
    # Every parameter on one stage, the tied weight on both the first and the last.
    assert sum(s.params_per_rank for s in stages) == model.total_params + model.tied.total
    assert stages[1].params_per_rank == 2 * model.blocks[0].total
    assert estimate_memory(model, ParallelLayout(3, "none", pp_size=3), batch) == max(
        stages, key=lambda s: s.total
    )
    # 1F1B: stage s keeps pp - s micro-batches in flight; GPipe keeps all of them.
    per_micro_batch = stages[2].parts["layers"]
    assert [s.parts["layers"] for s in stages] == [3 * per_micro_batch, 2 * per_micro_batch, per_micro_batch]
    gpipe = estimate_stages(model, ParallelLayout(3, "none", pp_size=3, pp_schedule="gpipe"), batch)
    assert [s.parts["layers"] for s in gpipe] == [8 * per_micro_batch] * 3
    assert [s.parts["logits"] > 0 for s in stages] == [False, False, True]


def test_layouts_that_do_not_fit_name_the_field():
    model = llama_layout(**dict(LLAMA3_8B, layers=2))
    with pytest.raises(ValueError, match="tp_size x pp_size"):
        estimate_memory(model, ParallelLayout(6, "fsdp2", tp_size=4), BatchShape(1, 8))
    with pytest.raises(ValueError, match="replicate"):
        estimate_memory(model, ParallelLayout(8, "fsdp2", replicate=3), BatchShape(1, 8))
    with pytest.raises(ValueError, match="pp_size"):
        estimate_memory(model, ParallelLayout(4, "none", pp_size=4), BatchShape(1, 8))


# ----------------------------------------------------------------------------- plan and doc


def test_plan_memory_builds_on_meta_and_counts_the_recipe_model():
    config = dataclasses.replace(Config(), parallel=ParallelConfig(strategy="fsdp2"))
    section = plan_memory(config, spec.model_factory, world_size=2)
    model = TinyGPT(ModelConfig())
    assert section["model_params"] == numel(model)
    assert section["params_per_rank"] == math.ceil(numel(model) / 2)
    assert section["seq_len"] == 128 and section["stages"] == 1
    assert section["total"] == sum(
        section[k] for k in ("parameters", "gradients", "optimizer_state", "transient_weights", "activations")
    )



def test_an_objective_adds_its_frozen_weights_and_its_rows_per_sample_to_the_plan():
    from types import SimpleNamespace

    config = dataclasses.replace(Config(), parallel=ParallelConfig(strategy="fsdp2"))
    plain = plan_memory(config, spec.model_factory, world_size=2)
    pairs = plan_memory(config, spec.model_factory, 2, SimpleNamespace(frozen_model=spec.model_factory, rows_per_sample=2))
    doubled = plan_memory(dataclasses.replace(config, train=dataclasses.replace(config.train, micro_batch_size=2 * config.train.micro_batch_size)),
                          spec.model_factory, world_size=2)  # fmt: skip
    assert pairs["activations"] == doubled["activations"] > plain["activations"]  # a pair is two rows
    assert pairs["micro_batch_size"] == plain["micro_batch_size"]  # the setting as the user gave it
    assert pairs["frozen_weights"] == plain["parameters"]  # a frozen copy, sharded like the trained model
    assert pairs["total"] == doubled["total"] + pairs["frozen_weights"]

def test_doc_tables_are_the_functions_output():
    """docs/distributed.md's memory tables are `doc_tables` of the tiny GPT recipe's defaults (the
    command that regenerates them is in the docs)."""
    from recipes import tiny_gpt

    assert doc_tables(tiny_gpt.Config(), tiny_gpt.spec.model_factory) in DOC.read_text()


def test_estimate_and_plan_modules_import_no_torch():
    code = "import sys, fntrain.plan.estimate, fntrain.plan.tables, fntrain.mesh_layout, fntrain.plan.report; print('torch' in sys.modules)"
    result = run_to_end([sys.executable, "-c", code], "the import of fntrain's plan modules", 120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "False"
