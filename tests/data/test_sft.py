"""Supervised fine-tuning data (fntrain.data.sft): the transform and its label masking (with a stand-in
tokenizer), padding, and packing that keeps examples apart: a packed window gives every example exactly
the logits it gets alone, in a transformers Llama (sdpa) and in fntrain.models.gpt's TinyGPT."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jinja2
import pytest
import torch

from fntrain.config import ConfigError
from fntrain.data.packing import PADDING_DOCUMENT, PackedDocuments
from fntrain.data.sft import (
    IGNORE_INDEX,
    Example,
    PaddedExamples,
    SFTDataConfig,
    build_dataset,
    build_examples,
    build_sft_datasets,
    pack_examples,
    read_jsonl,
    transform_example,
)
from fntrain.data.sft_collate import make_sft_collate
from fntrain.data.tokens import count_loss_tokens, loss_targets
from fntrain.step import default_forward
from tests.helpers.files import write_jsonl
from tests.helpers.hf import CHATS, TEMPLATE
from tests.helpers.model_assets import Assets


class CharTokenizer:
    """A stand-in for a Hugging Face tokenizer: one token per character, <s> </s> <pad> special."""

    SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2}
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, *, is_fast: bool = True, chat_template: str | None = TEMPLATE):
        self.is_fast = is_fast
        self.chat_template = chat_template

    def __len__(self) -> int:
        return 300

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets, position = [], [], 0
        while position < len(text):
            special = next((s for s in self.SPECIAL if text.startswith(s, position)), None)
            if special:
                ids.append(self.SPECIAL[special])
                offsets.append((position, position + len(special)))
                position += len(special)
            else:
                ids.append(ord(text[position]) + 10)
                offsets.append((position, position + 1))
                position += 1
        return ids, offsets

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids, offsets = self._encode(text)
        if add_special_tokens:
            ids, offsets = [self.bos_token_id, *ids], [(0, 0), *offsets]
        out = {"input_ids": ids}
        if return_offsets_mapping:
            assert self.is_fast, "a slow tokenizer has no offsets"
            out["offset_mapping"] = offsets
        return out

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        template = jinja2.Environment().from_string(self.chat_template)
        return template.render(
            messages=messages, bos_token="<s>", add_generation_prompt=add_generation_prompt
        )

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.SPECIAL.items()}
        return "".join(names.get(i, chr(i - 10) if i >= 10 else "?") for i in ids)


def assets_of(tokenizer) -> Assets:
    return Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.chat_template)


def trained_text(example: Example, tokenizer) -> str:
    return tokenizer.decode([label for label in example.labels if label != IGNORE_INDEX])


# ----------------------------------------------------------------------------- transform and masking


@pytest.mark.parametrize("is_fast", [True, False])
def test_chat_labels_mask_every_prompt_token(is_fast):
    tokenizer = CharTokenizer(is_fast=is_fast)
    data = SFTDataConfig()
    single = transform_example({"messages": CHATS[0]}, assets_of(tokenizer), data)
    assert (
        tokenizer.decode(single.input_ids) == "<s><|user|>\nWho art thou?</s>\n<|assistant|>\nA king.</s>\n"
    )
    # Only the reply and its end-of-turn marker are trained on; the BOS, roles and user turn are not.
    assert trained_text(single, tokenizer) == "A king.</s>\n"
    first_trained = next(i for i, label in enumerate(single.labels) if label != IGNORE_INDEX)
    assert tokenizer.decode(single.input_ids[:first_trained]).endswith("<|assistant|>\n")
    assert all(
        label in (IGNORE_INDEX, token) for token, label in zip(single.input_ids, single.labels, strict=True)
    )

    multi = transform_example({"messages": CHATS[1]}, assets_of(tokenizer), data)
    assert trained_text(multi, tokenizer) == "Well met.</s>\nLa la.</s>\n"
    everything = transform_example(
        {"messages": CHATS[1]}, assets_of(tokenizer), dataclasses.replace(data, train_on_prompt=True)
    )
    assert everything.labels == everything.input_ids


def test_prompt_completion_and_text_examples():
    tokenizer = CharTokenizer()
    data = SFTDataConfig()
    pair = transform_example({"prompt": "Q: 2+2? A:", "completion": " 4"}, assets_of(tokenizer), data)
    assert tokenizer.decode(pair.input_ids) == "<s>Q: 2+2? A: 4</s>"
    assert trained_text(pair, tokenizer) == " 4</s>"
    text = transform_example({"text": "To be."}, assets_of(tokenizer), data)
    assert text.labels == text.input_ids and tokenizer.decode(text.input_ids) == "<s>To be.</s>"
    no_eos = transform_example(
        {"text": "To be."}, assets_of(tokenizer), dataclasses.replace(data, add_eos=False)
    )
    assert tokenizer.decode(no_eos.input_ids) == "<s>To be."
    custom = dataclasses.replace(data, format="prompt_completion", prompt_key="q", completion_key="a")
    assert (
        trained_text(transform_example({"q": "x", "a": "y"}, assets_of(tokenizer), custom), tokenizer)
        == "y</s>"
    )


class EosAppendingTokenizer(CharTokenizer):
    """A tokenizer that ends every text it encodes with special tokens with its EOS (ByT5's, or a Llama
    tokenizer with add_eos_token)."""

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        out = super().__call__(text, add_special_tokens, return_offsets_mapping)
        if add_special_tokens:
            out["input_ids"] = [*out["input_ids"], self.eos_token_id]
            if return_offsets_mapping:
                out["offset_mapping"] = [*out["offset_mapping"], (0, 0)]
        return out


@pytest.mark.parametrize("is_fast", [True, False])
def test_a_tokenizer_that_appends_the_eos_itself_ends_an_answer_with_one_trained_eos(is_fast):
    """The model must learn to stop after the answer: one EOS after it, trained on (not the tokenizer's
    masked one followed by fntrain's), as for a text example."""
    tokenizer = EosAppendingTokenizer(is_fast=is_fast)
    pair = transform_example({"prompt": "Q: 2+2? A:", "completion": " 4"}, assets_of(tokenizer), SFTDataConfig())
    assert tokenizer.decode(pair.input_ids) == "<s>Q: 2+2? A: 4</s>"
    assert trained_text(pair, tokenizer) == " 4</s>"
    text = transform_example({"text": "To be."}, assets_of(tokenizer), SFTDataConfig())
    assert tokenizer.decode(text.input_ids) == "<s>To be.</s>" and text.labels == text.input_ids


def test_transform_errors_name_the_example():
    tokenizer = CharTokenizer()
    data = SFTDataConfig()
    with pytest.raises(ValueError, match="cannot tell the format"):
        transform_example({"body": "x"}, assets_of(tokenizer), data, where="example 3")
    with pytest.raises(ValueError, match="example 3: 'text' must be a str"):
        transform_example({"text": 5}, assets_of(tokenizer), data, where="example 3")
    with pytest.raises(ValueError, match="message 0 must be an object"):
        transform_example({"messages": ["hi"]}, assets_of(tokenizer), data)
    with pytest.raises(ValueError, match="set assets.chat_template"):
        transform_example({"messages": CHATS[0]}, assets_of(CharTokenizer(chat_template=None)), data)
    odd = CharTokenizer(chat_template="{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="prefixes"):
        transform_example({"messages": CHATS[0]}, assets_of(odd), data)
    failing = CharTokenizer(chat_template="{{ messages[5]['content'].upper() }}")  # a template that raises
    with pytest.raises(ConfigError, match=r"example 3: the chat template fails on this conversation \(.+\)"):
        transform_example({"messages": CHATS[0]}, assets_of(failing), data, where="example 3")


def test_bad_jsonl_lines_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        read_jsonl(str(path))
    path.write_text('{"text": "a"}\n[1]\n')
    with pytest.raises(ConfigError, match="line 2: expected a JSON object, got list"):
        read_jsonl(str(path))
    with pytest.raises(ConfigError, match="data.path"):
        read_jsonl(str(tmp_path / "missing.jsonl"))


ROWS = [{"prompt": "to be", "completion": " or not"}] * 4
GOOD = "".join(json.dumps(row) + "\n" for row in ROWS)


@pytest.mark.parametrize(
    "name, content, changes, message",
    [
        ("bad.jsonl", GOOD[: len(GOOD) // 2] + "{not json\n" + GOOD, {},
         r"data.path 'bad.jsonl' line 3: not JSON \(Expecting property name enclosed in double quotes: column 2\)"),
        ("prose.jsonl", "It was the best of times.\nIt was the worst.\n", {}, r"data.path 'prose.jsonl' line 1: not JSON"),
        ("empty.jsonl", "", {}, r"data.path 'empty.jsonl' is empty: expected one JSON object per line"),
        ("blank.jsonl", "\n\n  \n", {}, r"data.path 'blank.jsonl' is empty"),
        ("array.jsonl", GOOD + "[1, 2]\n", {}, r"data.path 'array.jsonl' line 5: expected a JSON object, got list \[1, 2\]"),
        ("nofield.jsonl", '{"title": "x"}\n' * 4, {},
         r"data.path 'nofield.jsonl' line 1: cannot tell the format of an example with keys \['title'\]"),
        ("late.jsonl", GOOD + '{"prompt": "a"}\n', {},  # found at build time, not at the step that reads it
         r"data.path 'late.jsonl' line 5: cannot tell the format"),
        ("chat.jsonl", GOOD, {"format": "chat"},
         r"data.path 'chat.jsonl' line 1: missing key 'messages' \(data.format 'chat' needs it; the example has "
         r"keys \['completion', 'prompt'\]\)"),
        ("texts.jsonl", GOOD, {"format": "text"}, r"data.path 'texts.jsonl' line 1: missing key 'text'"),
        ("typed.jsonl", '{"text": 5}\n', {}, r"data.path 'typed.jsonl' line 1: 'text' must be a str, got int"),
        ("binary.jsonl", bytes(range(256)) * 8, {}, r"data.path 'binary.jsonl' is not UTF-8 text"),
        ("notgz.jsonl.gz", GOOD, {}, r"data.path 'notgz.jsonl.gz': not a readable gzip file"),
        ("a-dir.jsonl", None, {}, r"data.path 'a-dir.jsonl' is a directory, not a file"),
        ("missing.jsonl", "", {"path": "nowhere.jsonl"}, r"data.path 'nowhere.jsonl' does not exist"),
        ("val.jsonl", GOOD, {"val_path": "bad-val.jsonl"}, r"data.val_path 'bad-val.jsonl' does not exist"),
    ],
)  # fmt: skip
def test_a_bad_data_file_is_one_line_naming_the_field_the_file_and_the_line(tmp_path, monkeypatch, name, content,
                                                                            changes, message):  # fmt: skip
    """Every row is read and transformed when the datasets are built (the run's first phase): the
    error is a `ConfigError` naming the field, the file as typed (relative here) and the line."""
    monkeypatch.chdir(tmp_path)
    if content is None:
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    data = dataclasses.replace(SFTDataConfig(path=name, max_length=32), **changes)
    with pytest.raises(ConfigError, match=message) as caught:
        data.validate()
        build_sft_datasets(data, assets_of(CharTokenizer()))
    assert "\n" not in str(caught.value)


def test_gzipped_jsonl_reads_like_plain_and_errors_name_the_line(tmp_path):
    import gzip

    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as file:
        file.write(GOOD)
    train, _ = build_sft_datasets(
        SFTDataConfig(path=str(tmp_path / "d.jsonl.gz")), assets_of(CharTokenizer())
    )
    assert len(train) == len(ROWS)
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as file:
        file.write(GOOD + "oops\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl.gz' line 5: not JSON"):
        read_jsonl(str(tmp_path / "bad.jsonl.gz"))


def test_config_validation_names_fields_and_checks_files(tmp_path):
    with pytest.raises(ValueError, match="data.path is required: a JSONL file of training examples"):
        SFTDataConfig().validate()
    with pytest.raises(ConfigError, match="data.path '.*missing.jsonl' does not exist"):
        SFTDataConfig(path=str(tmp_path / "missing.jsonl")).validate()
    with pytest.raises(ConfigError, match="data.path '.*' is a directory, not a file"):
        SFTDataConfig(path=str(tmp_path)).validate()
    base = SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}]))
    base.validate()
    with pytest.raises(ConfigError, match="sft.val_path"):
        dataclasses.replace(base, val_path=str(tmp_path / "nope.jsonl")).validate("sft")
    with pytest.raises(ValueError, match="data.max_length must be >= 2"):
        dataclasses.replace(base, max_length=1).validate()
    with pytest.raises(TypeError, match="data.packing must be a bool"):
        dataclasses.replace(base, packing=1).validate()
    with pytest.raises(ValueError, match="data.pad_to must be one of"):
        dataclasses.replace(base, pad_to="nearest").validate()
    with pytest.raises(ValueError, match="data.val_fraction must be <= 0.5"):
        dataclasses.replace(base, val_fraction=0.9).validate()
    with pytest.raises(ValueError, match="data.text_key must not be empty"):
        dataclasses.replace(base, text_key="").validate()


# ----------------------------------------------------------------------------- padding


def test_examples_without_trained_tokens_are_dropped_and_padding_collates(tmp_path):
    tokenizer = CharTokenizer()
    lines = [{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "no reply"}]}, {"text": "Hi"}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    data = SFTDataConfig(path=str(path), max_length=40)
    examples = build_examples(read_jsonl(str(path)), assets_of(tokenizer), data)
    assert len(examples) == 2  # the chat with no assistant turn trains on nothing

    dataset = build_dataset(examples, data)
    assert isinstance(dataset, PaddedExamples)
    assert len(dataset) == 2 and dataset.truncated == 1  # the first chat is longer than 40 tokens
    batch = make_sft_collate(0, max_length=40)([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 40)
    length = len(examples[1].input_ids)
    assert batch["attention_mask"][1].tolist() == [1] * length + [0] * (40 - length)
    assert (batch["labels"][1, length:] == IGNORE_INDEX).all() and (batch["input_ids"][1, length:] == 0).all()
    assert batch["labels"][1, :length].tolist() == list(examples[1].labels)
    longest = make_sft_collate(0, max_length=40, pad_to="longest")([dataset[1]])
    assert longest["input_ids"].shape == (1, length) and "attention_mask" not in longest


def test_validation_split_and_truncated_away_examples(tmp_path):
    tokenizer = CharTokenizer()
    train_path = write_jsonl(tmp_path / "train.jsonl", [{"text": f"line {i}"} for i in range(8)])
    val_path = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "p", "completion": "c"}])
    data = SFTDataConfig(path=train_path, val_fraction=0.25)
    train_set, val_set = build_sft_datasets(data, assets_of(tokenizer))
    assert (len(train_set), len(val_set)) == (6, 2)
    assert val_set[1]["input_ids"] == list(
        transform_example({"text": "line 7"}, assets_of(tokenizer), data).input_ids
    )
    train_set, val_set = build_sft_datasets(
        dataclasses.replace(data, val_path=val_path), assets_of(tokenizer)
    )
    assert (len(train_set), len(val_set)) == (8, 1)
    assert build_sft_datasets(dataclasses.replace(data, val_fraction=0.0), assets_of(tokenizer))[1] is None

    # A completion that starts after max_length leaves nothing to train on once truncated: dropped.
    long_prompt = {"prompt": "x" * 50, "completion": "y"}
    kept = build_examples([long_prompt, {"text": "ok"}], assets_of(tokenizer), SFTDataConfig(max_length=20))
    assert len(kept) == 1 and tokenizer.decode(kept[0].input_ids) == "<s>ok</s>"
    packed = build_examples([long_prompt], assets_of(tokenizer), SFTDataConfig(max_length=20, packing=True))
    assert len(packed) == 1  # packing keeps every token, so the completion survives


# ----------------------------------------------------------------------------- packing keeps examples apart


def chat_examples(data: SFTDataConfig) -> list[Example]:
    tokenizer = CharTokenizer()
    records = [{"messages": chat} for chat in CHATS] + [{"text": t} for t in ("To be.", "Or not.", "Aye")]
    return [transform_example(record, assets_of(tokenizer), data) for record in records]


def documents_of(batch: dict, row: int) -> list[torch.Tensor]:
    """The positions (boolean masks) of each non-padding document of one packed row."""
    ids = batch["document_ids"][row]
    return [ids == document for document in ids.unique().tolist() if document != PADDING_DOCUMENT]


def test_packing_keeps_every_token_and_each_example_apart():
    data = SFTDataConfig(packing=True, max_length=128)  # the longest chat fits whole
    examples = chat_examples(data)
    dataset = build_dataset(examples, data, pad_id=0)
    assert isinstance(dataset, PackedDocuments) and len(dataset) < len(examples)  # examples share windows
    batch = make_sft_collate(0, max_length=128)([dataset[i] for i in range(len(dataset))])
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids", "attention_mask"}
    assert batch["attention_mask"].shape == (len(dataset), 1, 128, 128)
    assert batch["attention_mask"].dtype == torch.bool

    found = []
    for row in range(len(dataset)):
        for where in documents_of(batch, row):
            ids, labels = batch["input_ids"][row][where].tolist(), batch["labels"][row][where].tolist()
            example = next(e for e in examples if list(e.input_ids) == ids)
            found.append(example)
            # Positions restart at 0; the first label is never a target, the others are the example's own.
            assert batch["position_ids"][row][where].tolist() == list(range(len(ids)))
            assert labels == [IGNORE_INDEX, *example.labels[1:]]
            # Attention: a token sees exactly the earlier tokens of its own example.
            mask = batch["attention_mask"][row, 0]
            assert torch.equal(mask[where][:, where], torch.ones(len(ids), len(ids), dtype=torch.bool).tril())
            assert not mask[where][:, ~where].any()
        tail = batch["document_ids"][row] == PADDING_DOCUMENT  # the window's tail is padding, no loss
        assert (batch["labels"][row][tail] == IGNORE_INDEX).all() and (
            batch["input_ids"][row][tail] == 0
        ).all()
    assert sorted(found, key=examples.index) == examples  # every example exactly once: no token dropped

    # No loss target crosses from one example into the next or sits on padding.
    targets, valid = loss_targets(batch)
    documents = batch["document_ids"]
    same = (documents[..., 1:] == documents[..., :-1]) & (documents[..., 1:] != PADDING_DOCUMENT)
    assert bool(same[valid].all())
    assert int(count_loss_tokens(batch)) == sum(
        sum(label != IGNORE_INDEX for label in e.labels[1:]) for e in examples
    )


def test_packing_splits_long_examples_into_windows():
    long = Example(tuple(range(10, 30)), tuple(range(10, 30)))
    packed = pack_examples([long, Example((5, 6), (5, 6))], 8, pad_id=3)
    rows = [packed[i] for i in range(len(packed))]
    assert len(rows) == 3  # 8 + 8 + (4 + 2 + 2 padding)
    assert [t for r in rows for t in r["input_ids"].tolist() if t >= 10] == list(range(10, 30))
    assert all(r["position_ids"][0] == 0 for r in rows)  # each piece is a document of its own
    assert rows[2]["input_ids"].tolist()[-2:] == [3, 3] and rows[2]["document_ids"].tolist()[-2:] == [-1, -1]


def _packed_window_and_examples(vocab: int, context: int) -> tuple[dict, list[list[int]]]:
    generator = torch.Generator().manual_seed(0)
    lengths = (5, 9, 3, 12, 7, 4)
    token_lists = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    examples = [Example(tuple(t), tuple(t)) for t in token_lists]
    packed = pack_examples(examples, context, pad_id=0)
    batch = make_sft_collate(0, max_length=context)([packed[i] for i in range(len(packed))])
    return batch, token_lists


def _assert_each_example_as_if_alone(model: Any, context: int, vocab: int) -> None:
    batch, token_lists = _packed_window_and_examples(vocab, context)
    assert batch["input_ids"].shape[0] < len(token_lists)  # several examples share a window
    with torch.no_grad():
        logits = default_forward(model, batch)  # what the training step passes: ids, mask, positions
        logits = getattr(logits, "logits", logits)
        seen = 0
        for row in range(batch["input_ids"].shape[0]):
            for where in documents_of(batch, row):
                tokens = batch["input_ids"][row][where].tolist()
                assert tokens in token_lists
                alone = model(torch.tensor([tokens]))
                alone = getattr(alone, "logits", alone)[0]
                torch.testing.assert_close(logits[row][where], alone, atol=1e-5, rtol=0)
                seen += 1
        assert seen == len(token_lists)
        # Control: without the mask and positions the examples see each other.
        leaky = model(batch["input_ids"])
        assert (getattr(leaky, "logits", leaky) - logits).abs().max() > 1e-3


def test_packed_logits_equal_each_example_alone_in_a_transformers_llama():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"
    _assert_each_example_as_if_alone(model, context=24, vocab=64)


def test_packed_logits_equal_each_example_alone_in_tiny_gpt():
    try:
        from fntrain.models.gpt import ModelConfig, TinyGPT
    except ImportError as error:  # the recipe may be mid-rewrite; the Llama test covers the contract
        pytest.skip(f"fntrain.models.gpt.TinyGPT is not importable: {error}")
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=24, n_layer=2, n_head=2, d_model=32, vocab_size=64)).eval()
    _assert_each_example_as_if_alone(model, context=24, vocab=64)


def test_padding_goes_to_the_longest_row_rounded_up_to_eight_by_default():
    """[issue 27] a 2048-token max_length must not pad every batch to 2048: the default pads to the
    longest row rounded up to data.pad_multiple (8), at most max_length; pad_to max_length gives static
    shapes."""
    data = SFTDataConfig(path="x.jsonl", max_length=20)
    assert (data.pad_to, data.pad_multiple) == ("longest", 8)

    def samples(*lengths):
        return [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]

    collate = make_sft_collate(0, max_length=data.max_length, pad_to=data.pad_to, pad_multiple=data.pad_multiple)
    batch = collate(samples(5, 11))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 16)
    assert batch["attention_mask"][1].tolist() == [1] * 11 + [0] * 5
    assert (batch["labels"][0, 5:] == IGNORE_INDEX).all()
    assert collate(samples(3))["input_ids"].shape == (1, 8)
    assert collate(samples(8, 8))["input_ids"].shape == (2, 8) and "attention_mask" not in collate(samples(8, 8))
    assert collate(samples(17))["input_ids"].shape == (1, 20)  # rounded up, capped at max_length
    static = make_sft_collate(0, max_length=20, pad_to="max_length", pad_multiple=8)
    assert static(samples(5, 11))["input_ids"].shape == (2, 20)
    assert make_sft_collate(0, max_length=20, pad_to="longest")(samples(5, 11))["input_ids"].shape == (2, 11)
    with pytest.raises(ValueError, match="data.pad_multiple"):
        dataclasses.replace(data, pad_multiple=0).validate()


def test_the_files_sft_data_reads_are_recorded_by_absolute_path(tmp_path, monkeypatch):
    from fntrain.run.resolved import recorded_config

    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / name).write_text("")
    recorded = recorded_config(SFTDataConfig(path="train.jsonl", val_path="./val.jsonl"))
    assert (recorded["path"], recorded["val_path"]) == (str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl"))
