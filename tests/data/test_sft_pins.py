"""Pins of `fntrain.data.sft` behaviours the SFT data tests left open (mutation testing): the exact one-line
errors a user gets (the field, the file, the line, the format settings as flags, the field a bad config
value is in), the warnings and the packing summary with their counts, the EOS appended once whatever
EOS the text already holds, empty and one-token examples, prompt training for prompt/completion pairs,
the pad id of packed windows, and table (Parquet) sources checked and read like JSONL."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from fntrain.config import ConfigError
from fntrain.data.packing import PADDING_DOCUMENT
from fntrain.data.sft import (
    Example,
    SFTDataConfig,
    build_dataset,
    build_examples,
    build_sft_datasets,
    example_format,
    pack_examples,
    read_jsonl,
    transform_example,
)
from tests.data.test_sft import CharTokenizer, assets_of
from tests.helpers.files import write_jsonl
from tests.helpers.hf import CHATS

LOG = "fntrain.data.sft"
EXPECTED_FORMATS = (
    "expected data.messages_key 'messages', data.prompt_key 'prompt' + data.completion_key 'completion' "
    "or data.text_key 'text'"
)


def sft_messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == level]


def decoded(example: Example) -> str:
    return CharTokenizer().decode(example.input_ids)


# ----------------------------------------------------------------------------- errors a user reads


@pytest.mark.parametrize(
    "record, message",
    [
        ({"body": "x"}, f"example: cannot tell the format of an example with keys ['body']: {EXPECTED_FORMATS}"),
        ({"prompt": "x"}, "example: cannot tell the format of an example with keys ['prompt']: data.completion_key "
                          f"'completion' is not among them; {EXPECTED_FORMATS}"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("call", ["example_format", "transform_example"])
def test_an_example_of_no_format_is_named_example_and_lists_every_format_as_its_flags(record, message, call):
    """Called without `where`, the error starts with "example"; each format is named by its key settings."""
    with pytest.raises(ConfigError) as caught:
        if call == "example_format":
            example_format(record, SFTDataConfig())
        else:
            transform_example(record, assets_of(CharTokenizer()), SFTDataConfig())
    assert str(caught.value) == message


WHERE = "data.path 'd.jsonl' line 4"


@pytest.mark.parametrize(
    "record, fmt, message",
    [
        ({"prompt": "x"}, "prompt_completion", "missing key 'completion' (data.format 'prompt_completion' needs it; "
                                               "the example has keys ['prompt']): check data.completion_key"),
        ({"completion": "x"}, "prompt_completion", "missing key 'prompt' (data.format 'prompt_completion' needs it; "
                                                   "the example has keys ['completion']): check data.prompt_key"),
        ({"prompt": "x"}, "text", "missing key 'text' (data.format 'text' needs it; the example has keys ['prompt']): "
                                  "check data.text_key"),
        ({"text": "x"}, "chat", "missing key 'messages' (data.format 'chat' needs it; the example has keys ['text']): "
                                "check data.messages_key"),
        ({"prompt": 1, "completion": "x"}, "auto", "'prompt' must be a str, got int"),
        ({"prompt": "x", "completion": None}, "auto", "'completion' must be a str, got NoneType"),
    ],
)  # fmt: skip
def test_a_record_that_does_not_fit_its_format_names_where_the_key_and_the_setting(record, fmt, message):
    data = SFTDataConfig(format=fmt)
    with pytest.raises(ConfigError) as caught:
        transform_example(record, assets_of(CharTokenizer()), data, where=WHERE)
    assert str(caught.value) == f"{WHERE}: {message}"


def test_build_examples_names_the_record_by_number_under_data_path_by_default():
    records = [{"text": "ok"}, {"text": 5}]
    with pytest.raises(ConfigError) as caught:
        build_examples(records, assets_of(CharTokenizer()), SFTDataConfig())
    assert str(caught.value) == "data.path example 2: 'text' must be a str, got int"


@pytest.mark.parametrize("field_name", [None, "data.val_path"])
def test_read_jsonl_names_the_field_it_is_given(tmp_path, field_name):
    path = str(tmp_path / "missing.jsonl")
    args = (path,) if field_name is None else (path, field_name)
    with pytest.raises(ConfigError) as caught:
        read_jsonl(*args)
    assert str(caught.value) == f"{field_name or 'data.path'} {path!r} does not exist"


def test_a_bad_validation_line_names_data_val_path_the_file_and_the_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}])
    (tmp_path / "val.jsonl").write_text('{"text": "b"}\n{"text": 7}\n')
    data = SFTDataConfig(path="train.jsonl", val_path="val.jsonl")
    with pytest.raises(ConfigError) as caught:
        build_sft_datasets(data, assets_of(CharTokenizer()))
    assert str(caught.value) == "data.val_path 'val.jsonl' line 2: 'text' must be a str, got int"


def test_a_val_fraction_that_leaves_no_training_example_says_so(tmp_path):
    data = SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}]), val_fraction=0.5)
    with pytest.raises(ConfigError) as caught:
        build_sft_datasets(data, assets_of(CharTokenizer()))
    assert str(caught.value) == "data.val_fraction 0.5 leaves no training example"


def test_a_file_with_nothing_to_train_on_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": ""}])
    data = SFTDataConfig(path="d.jsonl", add_eos=False)
    with pytest.raises(ConfigError) as caught:
        build_sft_datasets(data, assets_of(CharTokenizer()))
    assert str(caught.value) == "data.path 'd.jsonl' yields no example with a token to train on"


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"path": 5}, "TypeError: data.path must be a str, got 5"),
        ({"format": "xml"}, "ValueError: data.format must be one of ['auto', 'chat', 'prompt_completion', 'text'], "
                            "got 'xml'"),
    ],
)  # fmt: skip
def test_a_bad_config_value_names_its_field(tmp_path, changes, error):
    data = dataclasses.replace(
        SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}])), **changes
    )
    with pytest.raises((TypeError, ValueError)) as caught:
        data.validate()
    assert f"{type(caught.value).__name__}: {caught.value}" == error


def test_pad_multiple_one_is_valid(tmp_path):
    """pad_multiple 1 pads to the longest example exactly: a valid setting."""
    SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}]), pad_multiple=1).validate()


# ----------------------------------------------------------------------------- tokens and labels


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Hi", "<s>Hi</s>"),
        ("Hi</s>", "<s>Hi</s>"),  # already ends with EOS: not doubled
        ("</s>Hi", "<s></s>Hi</s>"),  # an EOS at the start or in the middle does not stand for the end
        ("H</s>i", "<s>H</s>i</s>"),
        ("", "<s></s>"),
    ],
)
@pytest.mark.parametrize("is_fast", [True, False])
def test_a_text_example_ends_with_exactly_one_eos(text, expected, is_fast):
    example = transform_example({"text": text}, assets_of(CharTokenizer(is_fast=is_fast)), SFTDataConfig())
    assert decoded(example) == expected and example.labels == example.input_ids


@pytest.mark.parametrize("is_fast", [True, False])
def test_train_on_prompt_trains_on_every_token_of_a_prompt_completion_pair(is_fast):
    tokenizer = CharTokenizer(is_fast=is_fast)
    record = {"prompt": "Q?", "completion": " A"}
    example = transform_example(record, assets_of(tokenizer), SFTDataConfig(train_on_prompt=True))
    assert decoded(example) == "<s>Q? A</s>" and example.labels == example.input_ids


class BoolOnlyTokenizer(CharTokenizer):
    """Like a Hugging Face fast tokenizer, refuses an `add_special_tokens` that is not a bool (the Rust
    tokenizers raise "TypeError: 'None' is not an instance of 'bool'")."""

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"{add_special_tokens!r} is not an instance of 'bool'")
        return super().__call__(text, add_special_tokens, return_offsets_mapping)


@pytest.mark.parametrize(
    "record", [{"messages": CHATS[0]}, {"prompt": "Q?", "completion": " A"}, {"text": "A"}]
)
def test_every_format_tokenizes_with_a_tokenizer_that_takes_only_bools(record):
    tokenizer = BoolOnlyTokenizer()
    example = transform_example(record, assets_of(tokenizer), SFTDataConfig())
    assert decoded(example).count("<s>") == 1  # the chat template's BOS, or the tokenizer's: never both


@pytest.mark.parametrize("packing", [False, True])
def test_an_example_whose_only_target_is_its_second_token_is_kept(packing):
    """The first label is never a target; a two-token example trains on its second token, so it stays."""
    data = SFTDataConfig(add_eos=False, max_length=8, packing=packing)
    examples = build_examples([{"text": "a"}], assets_of(CharTokenizer()), data)
    assert [decoded(e) for e in examples] == ["<s>a"]


# ----------------------------------------------------------------------------- warnings and the packing summary


NOTHING = {"messages": [{"role": "user", "content": "no reply"}]}


@pytest.mark.parametrize("records, warning", [
    ([NOTHING, {"text": "a"}, NOTHING], "data.path: dropped 2 of 3 examples with no token to train on"),
    ([{"text": "a"}, NOTHING], "data.path: dropped 1 of 2 examples with no token to train on"),
    ([{"text": "a"}, {"text": "b"}], None),
])  # fmt: skip
def test_dropped_examples_are_counted_in_one_warning(caplog, records, warning):
    with caplog.at_level(logging.INFO, logger=LOG):
        kept = build_examples(records, assets_of(CharTokenizer()), SFTDataConfig())
    assert len(kept) == sum(record is not NOTHING for record in records)
    assert sft_messages(caplog, logging.WARNING) == ([warning] if warning else [])


@pytest.mark.parametrize("lengths, truncated", [((9, 8, 3), 1), ((8, 8), 0), ((12, 10, 7), 2)])
def test_only_examples_longer_than_max_length_are_counted_as_truncated(caplog, lengths, truncated):
    examples = [Example(tuple(range(3, 3 + n)), tuple(range(3, 3 + n))) for n in lengths]
    with caplog.at_level(logging.INFO, logger=LOG):
        dataset = build_dataset(examples, SFTDataConfig(max_length=8))
    assert dataset.truncated == truncated
    assert sft_messages(caplog, logging.WARNING) == (
        [f"{truncated} examples are longer than data.max_length (8) and are truncated"] if truncated else []
    )
    assert [len(dataset[i]["input_ids"]) for i in range(len(dataset))] == [min(n, 8) for n in lengths]


@pytest.mark.parametrize("lengths, summary", [
    ((6, 6), "packed 2 examples into 2 windows of 8 tokens (75% filled)"),
    ((3, 3, 2), "packed 3 examples into 1 windows of 8 tokens (100% filled)"),
    ((5, 2, 4), "packed 3 examples into 2 windows of 8 tokens (69% filled)"),
])  # fmt: skip
def test_packing_logs_examples_windows_length_and_fill(caplog, lengths, summary):
    examples = [Example(tuple(range(3, 3 + n)), tuple(range(3, 3 + n))) for n in lengths]
    with caplog.at_level(logging.INFO, logger=LOG):
        build_dataset(examples, SFTDataConfig(max_length=8, packing=True))
    assert sft_messages(caplog, logging.INFO) == [summary]


# ----------------------------------------------------------------------------- the pad id of packed windows


def padding_of(dataset) -> set[int]:
    rows = [dataset[i] for i in range(len(dataset))]
    return {t for r in rows for t in r["input_ids"][r["document_ids"] == PADDING_DOCUMENT].tolist()}


def test_packed_windows_pad_with_id_zero_unless_told():
    examples = [Example((5, 6, 7), (5, 6, 7))]
    data = SFTDataConfig(max_length=8, packing=True)
    assert padding_of(pack_examples(examples, 8)) == padding_of(build_dataset(examples, data)) == {0}
    assert padding_of(pack_examples(examples, 8, pad_id=4)) == padding_of(
        build_dataset(examples, data, pad_id=4)
    )
    assert padding_of(build_dataset(examples, data, pad_id=4)) == {4}


def test_packed_train_and_validation_windows_pad_with_the_tokenizers_pad_id(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "abc"}, {"text": "de"}])
    assets = dataclasses.replace(assets_of(CharTokenizer()), pad_id=9)
    for changes in ({"val_fraction": 0.5}, {"val_path": path}):
        data = SFTDataConfig(path=path, max_length=16, packing=True, **changes)
        train_set, val_set = build_sft_datasets(data, assets)
        assert padding_of(train_set) == padding_of(val_set) == {9}


# ----------------------------------------------------------------------------- table sources


def table_of(pa, rows: list[dict]):
    """The rows as a table with every key a column (null where a row lacks it)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return pa.Table.from_pylist([{k: row.get(k) for k in keys} for row in rows])


def test_a_parquet_file_gives_the_examples_of_the_same_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"text": "To be."}, {"prompt": "Q?", "completion": " A"}, {"text": "Or not."}]
    pq.write_table(table_of(pa, rows), tmp_path / "d.parquet")
    assets = assets_of(CharTokenizer())
    table, _ = build_sft_datasets(SFTDataConfig(path=str(tmp_path / "d.parquet")), assets)
    same, _ = build_sft_datasets(SFTDataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows)), assets)
    assert [table[i] for i in range(len(table))] == [same[i] for i in range(len(same))]


def test_a_null_cell_is_a_missing_key_and_only_the_key_columns_are_read(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    rows = [{"id": 0, "text": "To be."}, {"id": 1, "prompt": "Q?", "completion": " A"}]
    pq.write_table(table_of(pa, rows), "d.parquet")
    with pytest.raises(ConfigError) as caught:
        build_sft_datasets(SFTDataConfig(path="d.parquet", format="text"), assets_of(CharTokenizer()))
    assert str(caught.value) == (
        "data.path 'd.parquet' row 1: missing key 'text' (data.format 'text' needs it; the example has keys "
        "['completion', 'prompt']): check data.text_key"
    )


@pytest.mark.parametrize("fmt, expected", [
    ("text", "data.text_key 'text'"),
    ("chat", "data.messages_key 'messages'"),
])  # fmt: skip
def test_a_table_without_the_columns_of_its_format_is_refused_up_front(tmp_path, monkeypatch, fmt, expected):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.Table.from_pylist([{"prompt": "Q?", "completion": " A"}]), "d.parquet")
    with pytest.raises(ConfigError) as caught:
        build_sft_datasets(SFTDataConfig(path="d.parquet", format=fmt), assets_of(CharTokenizer()))
    assert str(caught.value) == (
        f"data.path 'd.parquet': cannot tell the format of its rows, with columns ['completion', 'prompt']: "
        f"expected {expected}"
    )


def test_a_table_with_no_format_lists_every_format_as_its_flags(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.Table.from_pylist([{"prompt": "Q?", "body": "x"}]), "d.parquet")
    with pytest.raises(ConfigError) as caught:
        build_sft_datasets(SFTDataConfig(path="d.parquet"), assets_of(CharTokenizer()))
    assert str(caught.value) == (
        "data.path 'd.parquet': cannot tell the format of its rows, with columns ['body', 'prompt']: "
        f"data.completion_key 'completion' is not among them; {EXPECTED_FORMATS}"
    )
