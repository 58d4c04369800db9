"""The tiny LLaVA and the VLM model glue: a deterministic build into a cache directory, the local-only
load / save_pretrained round trip, FLOPs that include the vision tower, greedy answers that do not
depend on left padding, and the model config's errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fntrain.data.shapes import ShapesQA, shapes_texts
from fntrain.data.vlm import (
    VLMDataConfig,
    make_vlm_collate,
    transform_vlm_example,
    vlm_prompt,
)
from fntrain.models.flops import measure_flops_per_token
from fntrain.models.vlm import (
    VLMModelConfig,
    answer_accuracy,
    build_tiny_llava,
    greedy_generate,
    load_processor,
    load_vlm,
    resolve_model_dir,
    save_vlm,
    vlm_forward,
    vlm_from_config,
)
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import ParallelConfig
from fntrain.step import causal_lm_loss
from tests.helpers.vlm import TINY

CPU = Runtime(rank=0, world_size=1, device=torch.device("cpu"))


def test_the_tiny_model_is_deterministic_and_cached(tiny_llava_dir, tmp_path):
    from safetensors.torch import load_file

    again = build_tiny_llava(tmp_path / "again", shapes_texts(), TINY)
    first, second = load_file(tiny_llava_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert (tiny_llava_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    stamp = (tiny_llava_dir / "model.safetensors").stat().st_mtime_ns
    config = VLMModelConfig(cache_dir=str(tiny_llava_dir.parent))
    assert resolve_model_dir(config, shapes_texts(), TINY) == tiny_llava_dir  # found, not rebuilt
    assert (tiny_llava_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tiny_llava_dir.parent.iterdir() if p.name.startswith(".build-")]


def test_load_save_round_trip_with_transformers(tiny_llava_dir, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = load_vlm(tiny_llava_dir, CPU, ParallelConfig())
    processor = load_processor(tiny_llava_dir)
    out = save_vlm(model, processor, tmp_path / "out", CPU)
    reloaded = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    again = AutoProcessor.from_pretrained(out, local_files_only=True)
    row = ShapesQA(1)[0]
    data = VLMDataConfig()
    a, b = transform_vlm_example(row, processor, data), transform_vlm_example(row, again, data)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])


def test_flops_per_token_include_the_vision_tower(tiny_llava_dir):
    processor = load_processor(tiny_llava_dir)
    rows = ShapesQA(4)
    batch = make_vlm_collate(processor.tokenizer.pad_token_id, max_length=512)(
        [transform_vlm_example(rows[i], processor, VLMDataConfig()) for i in range(4)]
    )

    def factory():
        return vlm_from_config(tiny_llava_dir)

    def text_only(model, micro_batch):
        hidden = model.model.language_model(input_ids=micro_batch["input_ids"]).last_hidden_state
        return model.lm_head(hidden)

    def vision_only(model, micro_batch):
        return model.model.vision_tower(micro_batch["pixel_values"]).last_hidden_state

    total = measure_flops_per_token(factory, batch, loss_fn=causal_lm_loss, forward=vlm_forward)
    text = measure_flops_per_token(factory, batch, loss_fn=causal_lm_loss, forward=text_only)
    vision = measure_flops_per_token(factory, batch, forward=vision_only)
    assert vision > 0 and total >= text + 0.99 * vision


def test_greedy_answers_do_not_depend_on_left_padding(tiny_llava_dir):
    processor = load_processor(tiny_llava_dir)
    torch.manual_seed(0)
    model = load_vlm(tiny_llava_dir, CPU, ParallelConfig())
    every = [vlm_prompt(row, processor, VLMDataConfig()) for row in ShapesQA(24, seed=2)]
    lengths = sorted({len(p["input_ids"]) for p in every})
    assert len(lengths) == 2  # the two questions differ in length: a batch of both is left-padded
    prompts = [p for p in every if len(p["input_ids"]) == lengths[0]][:3]
    prompts += [p for p in every if len(p["input_ids"]) == lengths[1]][:3]
    pad = processor.tokenizer.pad_token_id
    together = greedy_generate(model, prompts, pad_id=pad, max_new_tokens=3)
    alone = [greedy_generate(model, [p], pad_id=pad, max_new_tokens=3)[0] for p in prompts]
    assert together == alone
    reference = model.generate(
        input_ids=prompts[0]["input_ids"][None], pixel_values=prompts[0]["pixel_values"], max_new_tokens=3,
        min_new_tokens=3, do_sample=False,
    )  # fmt: skip
    assert reference[0, -3:].tolist() == alone[0]
    model.train()
    accuracy = answer_accuracy(model, processor, prompts, batch_size=4)
    said = [processor.tokenizer.decode(a, skip_special_tokens=True).split()[:1] for a in alone]
    assert accuracy == sum(s == [p["answer"]] for s, p in zip(said, prompts, strict=True)) / 6
    assert model.training  # answer_accuracy restores the mode it found


def test_model_config_errors_name_the_field(tmp_path):
    VLMModelConfig().validate()
    for change, words in (
        ({"path": str(tmp_path / "nope")}, "model.path"),
        ({"cache_dir": ""}, "model.cache_dir"),
        ({"dtype": "int8"}, "model.dtype"),
        ({"attn_implementation": "flex"}, "model.attn_implementation"),
    ):
        with pytest.raises((ValueError, TypeError, FileNotFoundError), match=words):
            dataclasses.replace(VLMModelConfig(), **change).validate()
    with pytest.raises(ValueError, match="image_size must be a multiple"):
        dataclasses.replace(TINY, image_size=18).validate()
