"""Preference data for DPO (fntrain.data.preference): rows -> chosen/rejected ids and labels as TRL 1.16
tokenizes them (EOS appended to text, prompt masked, chat rows through the template), keep_start
truncation counted in the log, the 2B-row collate, table sources, and every bad row one ConfigError
naming the flag, the file and the row. A byte-level BPE tokenizer is trained here in a few ms."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from fntrain.config import ConfigError
from fntrain.data.preference import (
    PreferenceDataConfig,
    PreferencePair,
    build_preference_datasets,
    make_preference_collate,
    preference_example,
    tokenize_pair,
)
from fntrain.data.tokens import IGNORE_INDEX
from tests.helpers.files import write_jsonl
from tests.helpers.model_assets import Assets

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LINES = ["the sky is blue", "the sea is green", "what color is the sky?", "hello there, friend"]
USER = [{"role": "user", "content": "What color is the sky?"}]


def tiny_tokenizer(chat_template: str | None = TEMPLATE) -> Any:
    """A byte-level BPE tokenizer (BOS prepended, </s> the EOS) trained on LINES."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(LINES, trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def ids(assets: Assets, text: str) -> list[int]:
    return assets.tokenizer(text=text)["input_ids"]


TEXT_ROWS = [
    {"prompt": "the sky is", "chosen": " blue", "rejected": " green"},
    {"prompt": "hello", "chosen": " there, friend", "rejected": " there</s>"},
    {"prompt": "the sea is", "chosen": " green", "rejected": " blue"},
]


# ----------------------------------------------------------------------------- tokenization


def test_text_row_masks_the_prompt_and_appends_eos(assets):
    data = PreferenceDataConfig(path="unused")
    pair = tokenize_pair(TEXT_ROWS[0], assets, data)
    prompt = ids(assets, "the sky is")
    assert pair.prompt_ids == tuple(prompt) and prompt[0] == assets.tokenizer.bos_token_id
    assert list(pair.prompt_ids + pair.chosen_ids) == ids(assets, "the sky is blue</s>")
    assert list(pair.prompt_ids + pair.rejected_ids) == ids(assets, "the sky is green</s>")
    assert pair.chosen_ids[-1] == pair.rejected_ids[-1] == assets.eos_id and not pair.prompt_cut
    example = preference_example(pair, 7, max_length=1024)
    n = len(prompt)
    assert example["index"] == 7
    assert example["chosen_input_ids"] == list(pair.prompt_ids + pair.chosen_ids)
    assert example["chosen_labels"] == [IGNORE_INDEX] * n + list(pair.chosen_ids)
    assert example["rejected_labels"] == [IGNORE_INDEX] * n + list(pair.rejected_ids)


def test_eos_not_doubled_and_completion_starts_at_the_common_prefix(assets):
    data = PreferenceDataConfig(path="unused")
    pair = tokenize_pair(TEXT_ROWS[1], assets, data)  # rejected already ends with </s>
    assert list(pair.prompt_ids + pair.rejected_ids) == ids(assets, "hello there</s>")
    # a prompt ending mid-word merges with the completion: the completion starts where the ids diverge
    merged = tokenize_pair(
        {"prompt": "the sk", "chosen": "y is blue", "rejected": "y is green"}, assets, data
    )
    full = ids(assets, "the sky is blue</s>")
    assert merged.prompt_cut and list(merged.prompt_ids + merged.chosen_ids) == full
    assert len(merged.prompt_ids) < len(ids(assets, "the sk"))


def test_chat_row_rendered_with_the_template(assets):
    data = PreferenceDataConfig(path="unused")
    row = {"prompt": USER, "chosen": [{"role": "assistant", "content": "blue"}], "rejected": "green"}
    pair = tokenize_pair(row, assets, data)
    tokenizer = assets.tokenizer
    prompt_text = "<s><|user|>\nWhat color is the sky?</s>\n<|assistant|>\n"
    assert tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True) == prompt_text
    assert tokenizer.decode(pair.prompt_ids) == prompt_text
    assert tokenizer.decode(pair.chosen_ids) == "blue</s>\n"  # the template's turn end, no EOS added
    assert tokenizer.decode(pair.rejected_ids) == "green</s>\n"  # a string is one assistant message
    rendered = tokenizer.apply_chat_template(
        USER + [{"role": "assistant", "content": "blue"}], tokenize=False
    )
    assert tokenizer.decode(pair.prompt_ids + pair.chosen_ids) == rendered


def test_keep_start_truncation_is_counted_in_the_log(assets, tmp_path, caplog):
    long = {"prompt": "hello", "chosen": " the sky is blue" * 4, "rejected": " no"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [long, TEXT_ROWS[0]])
    data = PreferenceDataConfig(path=path, max_length=8)
    with caplog.at_level(logging.WARNING, logger="fntrain.data.preference"):
        train, val = build_preference_datasets(data, assets)
    assert val is None and len(train) == 2 and train.truncated == 1
    assert f"data.path {path!r}: 1 of 2 rows truncated to data.max_length 8" in caplog.text
    example = train[0]
    full = ids(assets, "hello" + long["chosen"] + "</s>")
    assert example["chosen_input_ids"] == full[:8] and len(example["chosen_labels"]) == 8
    assert example["rejected_input_ids"] == ids(assets, "hello no</s>")  # each sequence cut on its own
    with pytest.raises(
        ConfigError, match=r"line 1: prompt \+ chosen takes \d+ tokens, more than data.max_length 8"
    ):
        build_preference_datasets(dataclasses.replace(data, truncation="error"), assets)


def test_collate_stacks_chosen_then_rejected(assets):
    data = PreferenceDataConfig(path="unused")
    examples = [
        preference_example(tokenize_pair(row, assets, data), i, 1024) for i, row in enumerate(TEXT_ROWS)
    ]
    batch = make_preference_collate(assets.pad_id, pad_multiple=8)(examples)
    lengths = [len(e[f"{side}_input_ids"]) for side in ("chosen", "rejected") for e in examples]
    width = -(-max(lengths) // 8) * 8
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (6, width)
    assert batch["index"].tolist() == [0, 1, 2] and batch["input_ids"].dtype == torch.long
    for row, (side, example) in enumerate((s, e) for s in ("chosen", "rejected") for e in examples):
        n = len(example[f"{side}_input_ids"])
        assert batch["input_ids"][row, :n].tolist() == example[f"{side}_input_ids"]
        assert batch["labels"][row, :n].tolist() == example[f"{side}_labels"]
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert (batch["input_ids"][row, n:] == assets.pad_id).all() and (
            batch["labels"][row, n:] == IGNORE_INDEX
        ).all()
    exact = make_preference_collate(assets.pad_id)(examples)  # pad_multiple 1: the longest, as TRL
    assert exact["input_ids"].shape[1] == max(lengths)


# ----------------------------------------------------------------------------- sources and splits


def test_parquet_save_to_disk_and_val_fraction(assets, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in TEXT_ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    chat = [{"q": USER, "good": [{"role": "assistant", "content": c}], "bad": [{"role": "assistant", "content": r}]}
            for c, r in (("blue", "red"), ("azure", "green"))]  # fmt: skip
    datasets.Dataset.from_list(chat).save_to_disk(str(tmp_path / "chat"))
    keys = {"prompt_key": "q", "chosen_key": "good", "rejected_key": "bad"}
    data = PreferenceDataConfig(path=str(tmp_path / "pairs.parquet"), val_fraction=0.34, **keys)
    train, val = build_preference_datasets(data, assets)
    assert len(train) == 2 and len(val) == 1 and val[0]["index"] == 0
    assert val[0]["chosen_input_ids"] == ids(assets, "the sea is green</s>")
    data = PreferenceDataConfig(path=str(tmp_path / "chat"), val_path=str(tmp_path / "pairs.parquet"), **keys)
    train, val = build_preference_datasets(data, assets)
    assert [train[i]["index"] for i in range(2)] == [0, 1] and len(val) == 3
    decoded = assets.tokenizer.decode(train[1]["chosen_input_ids"])
    assert decoded.endswith("<|assistant|>\nazure</s>\n")


def test_validate_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS)
    PreferenceDataConfig(path=path).validate()
    with pytest.raises(ValueError, match="data.path is required"):
        PreferenceDataConfig().validate()
    with pytest.raises(ConfigError, match=r"data.path '.*nope.jsonl' does not exist"):
        PreferenceDataConfig(path=str(tmp_path / "nope.jsonl")).validate()
    with pytest.raises(ValueError, match="data.truncation must be one of"):
        PreferenceDataConfig(path=path, truncation="keep_end").validate()
    with pytest.raises(ValueError, match="data.val_fraction must be <= 0.5"):
        PreferenceDataConfig(path=path, val_fraction=0.6).validate()
    with pytest.raises(ValueError, match="data.max_length must be >= 2"):
        PreferenceDataConfig(path=path, max_length=1).validate()
    with pytest.raises(ValueError, match="must differ"):
        PreferenceDataConfig(path=path, chosen_key="prompt").validate()


# ----------------------------------------------------------------------------- bad rows


BAD_ROWS = [
    ({"prompt": "a", "rejected": "b"}, r"line 2: missing key 'chosen' \(the row has keys \['prompt', 'rejected'\]\): check data.chosen_key"),
    ({"prompt": "a", "chosen": "b"}, r"line 2: missing key 'rejected' .*check data.rejected_key"),
    ({"chosen": "a", "rejected": "b"}, r"line 2: missing key 'prompt' .*check data.prompt_key"),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, r"line 2: chosen and rejected are the same"),
    ({"prompt": "a", "chosen": "b</s>", "rejected": "b"}, r"line 2: chosen and rejected tokenize to the same ids"),
    ({"prompt": "a", "chosen": 3, "rejected": "b"}, r"line 2: 'chosen' must be a string after a text prompt, got int \(data.chosen_key\)"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, r"line 2: 'prompt' must be a string or a list of chat messages, got int"),
    ({"prompt": USER, "chosen": [], "rejected": "b"}, r"line 2: 'chosen' must be a non-empty list of messages .*got an empty list"),
    ({"prompt": USER, "chosen": "a", "rejected": [{"role": "assistant"}]}, r"line 2: 'rejected' message 0 must be an object with 'role' and 'content'"),
    ({"prompt": "the sky is blue, the sea is green", "chosen": "a", "rejected": "b"}, r"line 2: the prompt takes \d+ tokens, leaving no room .*data.max_length 6"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "message"), BAD_ROWS)
def test_bad_row_is_one_config_error_naming_file_and_row(assets, tmp_path, row, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", [TEXT_ROWS[0], row])
    with pytest.raises(ConfigError, match=f"^data.path {path!r} " + message) as error:
        build_preference_datasets(PreferenceDataConfig(path=path, max_length=6), assets)
    assert "\n" not in str(error.value)


def test_bad_sources(assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"data.path '.*empty.jsonl' is empty"):
        build_preference_datasets(PreferenceDataConfig(path=str(empty)), assets)
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "chosen": "b"}]), tmp_path / "t.parquet")
    with pytest.raises(
        ConfigError, match=r"data.path '.*t.parquet': .*data.rejected_key 'rejected' is not among them"
    ):
        build_preference_datasets(PreferenceDataConfig(path=str(tmp_path / "t.parquet")), assets)
    one = write_jsonl(tmp_path / "one.jsonl", TEXT_ROWS[:1])
    with pytest.raises(ConfigError, match=r"data.val_fraction 0.5 leaves no training row"):
        build_preference_datasets(PreferenceDataConfig(path=one, val_fraction=0.5), assets)
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "b"}])
    with pytest.raises(
        ConfigError, match=r"^data.val_path '.*val.jsonl' line 1: chosen and rejected are the same"
    ):
        build_preference_datasets(PreferenceDataConfig(path=one, val_path=val), assets)


def test_chat_rows_need_a_template(tmp_path):
    tokenizer = tiny_tokenizer(chat_template=None)
    bare = Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, None)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": USER, "chosen": "a", "rejected": "b"}])
    with pytest.raises(
        ConfigError, match=r"line 1: rows with chat messages need a chat template.*assets.chat_template"
    ):
        build_preference_datasets(PreferenceDataConfig(path=path), bare)
    failing = tiny_tokenizer(chat_template="{{ raise_exception('no system turns') }}")
    broken = Assets(failing, failing.pad_token_id, failing.eos_token_id, "x")
    with pytest.raises(
        ConfigError, match=r"line 1: the chat template fails on this conversation \(no system turns\)"
    ):
        build_preference_datasets(PreferenceDataConfig(path=path), broken)


def test_pair_record_is_what_trl_keeps():
    pair = PreferencePair((1, 5), (6, 2), (7, 8, 2))
    example = preference_example(pair, 0, max_length=3)
    assert example == {
        "index": 0,
        "chosen_input_ids": [1, 5, 6],
        "chosen_labels": [IGNORE_INDEX, IGNORE_INDEX, 6],
        "rejected_input_ids": [1, 5, 7],
        "rejected_labels": [IGNORE_INDEX, IGNORE_INDEX, 7],
    }
