"""The vision-language data path: the generated shapes set, the multimodal transform (assistant-only
labels, image tokens ignored, images resized by the processor), JSONL rows, the collate, and the
config's errors naming their fields."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from fntrain.config import ConfigError
from fntrain.data.shapes import COLOURS, QUESTIONS, SHAPES, ShapesQA, draw_shape, write_shapes_jsonl
from fntrain.data.tokens import IGNORE_INDEX
from fntrain.data.vlm import (
    VLMDataConfig,
    build_vlm_datasets,
    make_vlm_collate,
    transform_vlm_example,
    vlm_prompt,
)
from tests.helpers.vlm import TINY, tiny_processor


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return tiny_processor(str(tmp_path_factory.getbasetemp() / "vlm_cache"))


def test_generated_rows_are_a_pure_function_of_seed_and_index():
    a, b = ShapesQA(8, seed=3), ShapesQA(8, seed=3)
    held_out = ShapesQA(8, seed=3, start=8)
    for index in range(8):
        assert np.array_equal(np.asarray(a[index]["image"]), np.asarray(b[index]["image"]))
        assert a[index]["messages"] == b[index]["messages"]
        assert not np.array_equal(np.asarray(a[index]["image"]), np.asarray(held_out[index]["image"]))
    answers = set()
    for row in ShapesQA(64, seed=0):
        (user, assistant) = row["messages"]
        question = user["content"][1]["text"]
        assert question in QUESTIONS.values() and row["image"].size == (48, 48)
        assert assistant["content"] in (COLOURS if question == QUESTIONS["colour"] else SHAPES)
        answers.add(assistant["content"])
    assert answers == set(COLOURS) | set(SHAPES)
    with pytest.raises(IndexError):
        ShapesQA(2)[2]


def test_a_square_is_painted_in_its_colour():
    rng = np.random.default_rng(0)
    for colour, rgb in COLOURS.items():
        image = np.asarray(draw_shape("square", colour, 48, rng)).astype(int)
        assert np.abs(image[24, 24] - np.array(rgb)).max() <= 20, colour  # the centre is always covered
    with pytest.raises(ValueError, match="unknown shape"):
        draw_shape("hexagon", "red", 16, rng)


def test_transform_trains_on_the_answer_only_and_masks_the_image_tokens(processor):
    row = ShapesQA(1, seed=0)[0]
    sample = transform_vlm_example(row, processor, VLMDataConfig())
    ids, labels = sample["input_ids"], sample["labels"]
    tokenizer = processor.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    per_image = (TINY.image_size // TINY.patch_size) ** 2
    assert int((ids == image_id).sum()) == per_image  # the processor expanded the placeholder
    assert (labels[ids == image_id] == IGNORE_INDEX).all()
    trained = [int(t) for t in labels if t != IGNORE_INDEX]
    assert tokenizer.convert_ids_to_tokens(trained) == [row["messages"][1]["content"], "</s>"]
    assert trained == ids[-2:].tolist()
    # 48-pixel images come out at the model's size: resized by the processor, not here.
    assert sample["pixel_values"].shape == (1, 3, TINY.image_size, TINY.image_size)

    prompt = vlm_prompt(row, processor, VLMDataConfig())
    assert prompt["answer"] == row["messages"][1]["content"]
    assert prompt["input_ids"].tolist() == ids[:-2].tolist()  # the prompt ends with "<|assistant|>"


def test_jsonl_rows_with_relative_image_paths_and_prompt_completion(processor, tmp_path):
    path = write_shapes_jsonl(tmp_path, 4, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert not rows[0]["image"].startswith("/")
    extra = {"image": rows[0]["image"], "prompt": "What shape is it?", "completion": "circle"}
    path.write_text(path.read_text() + json.dumps(extra) + "\n")
    data = VLMDataConfig(path=str(path), val_fraction=0.25)
    data.validate()
    train, val = build_vlm_datasets(data, processor)
    assert (len(train), len(val)) == (4, 1)
    sample = val[0]  # the prompt/completion row: a one-turn chat with the image first
    tokens = processor.tokenizer.convert_ids_to_tokens([int(t) for t in sample["labels"] if t != IGNORE_INDEX])
    assert tokens == ["circle", "</s>"]
    first = train[0]
    reference = transform_vlm_example(ShapesQA(4, seed=1)[0], processor, data)
    assert torch.equal(first["input_ids"], reference["input_ids"])
    torch.testing.assert_close(first["pixel_values"], reference["pixel_values"], atol=0.02, rtol=0)  # PNG round trip


def test_bad_rows_are_errors_naming_the_row(processor, tmp_path):
    data = VLMDataConfig()
    with pytest.raises(ConfigError, match="row 3: image 'missing.png' not found"):
        transform_vlm_example({"image": "missing.png", "prompt": "a", "completion": "b"}, processor, data,
                              root=tmp_path, where="row 3")  # fmt: skip
    row = ShapesQA(1)[0]
    with pytest.raises(ValueError, match="expected data.messages_key 'messages' or data.prompt_key 'prompt'"):
        transform_vlm_example({"image": row["image"], "text": "hi"}, processor, data)
    with pytest.raises(ValueError, match=r"exceed data.max_length \(8\)"):
        transform_vlm_example(row, processor, dataclasses.replace(data, max_length=8))


@pytest.mark.parametrize(
    "row, message",
    [
        ({"image": "shapes/missing.png", "prompt": "a", "completion": "b"},
         r"data.path 'vqa.jsonl' line 4: image 'shapes/missing.png' not found \(looked at .*shapes/missing.png\)"),
        ({"image": ["shapes/000000.png", "gone.png"], "prompt": "a", "completion": "b"},
         r"line 4: image 'gone.png' not found"),
        ({"image": 7, "prompt": "a", "completion": "b"}, r"line 4: an image must be a path, got int"),
        ({"image": "vqa.jsonl", "prompt": "a", "completion": "b"}, r"line 4: image '.*vqa.jsonl' is not an image Pillow reads"),
        ({"image": "shapes/000000.png", "text": "hi"}, r"line 4: cannot tell the format .*: expected data.messages_key 'messages' or data.prompt_key 'prompt' \+ data.completion_key 'completion'"),
        ({"image": "shapes/000000.png", "messages": [{"role": "user", "content": "hi"}]},
         r"line 4: no assistant turn to train on"),
        ({"image": "shapes/000000.png", "messages": ["hi"]}, r"line 4: message 0 must be an object"),
    ],
)  # fmt: skip
def test_bad_rows_are_found_when_the_datasets_are_built(tmp_path, monkeypatch, row, message):
    """Each row's conversation and image files are checked before training (no image decoded, no
    processor run), so a missing image is one line naming the file's line and the path, not a failure
    at the step that reads it."""
    monkeypatch.chdir(tmp_path)
    path = write_shapes_jsonl(tmp_path, 3, seed=0)
    (tmp_path / "vqa.jsonl").write_text(path.read_text() + json.dumps(row) + "\n")
    for data in (VLMDataConfig(path="vqa.jsonl"), VLMDataConfig(path="vqa.jsonl", val_fraction=0.3)):
        with pytest.raises(ConfigError, match=message):
            build_vlm_datasets(data, processor=None)
    clean = VLMDataConfig(path=str(path), val_path="vqa.jsonl")
    with pytest.raises(ConfigError, match=message.replace("data.path", "data.val_path")):
        build_vlm_datasets(clean, processor=None)


def test_an_empty_or_bad_vlm_jsonl_names_the_line(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"data.path '.*empty.jsonl' is empty"):
        build_vlm_datasets(VLMDataConfig(path=str(tmp_path / "empty.jsonl")), processor=None)
    (tmp_path / "bad.jsonl").write_text('{"image": "x.png"\n')
    with pytest.raises(ConfigError, match=r"data.path '.*bad.jsonl' line 1: not JSON"):
        build_vlm_datasets(VLMDataConfig(path=str(tmp_path / "bad.jsonl")), processor=None)


def test_collate_pads_text_and_stacks_images(processor):
    rows = ShapesQA(4, seed=0)
    samples = [transform_vlm_example(rows[i], processor, VLMDataConfig()) for i in range(4)]
    lengths = [len(s["input_ids"]) for s in samples]
    pad = processor.tokenizer.pad_token_id
    batch = make_vlm_collate(pad, max_length=512)(samples)
    assert batch["input_ids"].shape == (4, max(lengths))
    assert batch["pixel_values"].shape == (4, 3, TINY.image_size, TINY.image_size)
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        assert batch["attention_mask"][row].sum() == length
        assert torch.equal(batch["pixel_values"][row], sample["pixel_values"][0])
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
    static = make_vlm_collate(pad, max_length=40, pad_to="max_length")(samples)
    assert static["input_ids"].shape == (4, 40)
    text_only = make_vlm_collate(pad, max_length=8)([{"input_ids": [1, 2], "labels": [1, 2]}])
    assert "pixel_values" not in text_only


def test_config_errors_name_the_field(tmp_path):
    VLMDataConfig().validate()
    for change, words in (
        ({"max_length": 1}, "data.max_length"),
        ({"pad_to": "nearest"}, "data.pad_to"),
        ({"val_fraction": 0.9}, "data.val_fraction"),
        ({"train_samples": 0}, "data.train_samples"),
        ({"image_size": 4}, "data.image_size"),
        ({"image_key": ""}, "data.image_key"),
        ({"path": str(tmp_path / "nope.jsonl")}, "data.path"),
    ):
        with pytest.raises((ValueError, TypeError, FileNotFoundError), match=words):
            dataclasses.replace(VLMDataConfig(), **change).validate()
