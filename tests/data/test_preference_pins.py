"""Pins of fntrain/data/preference.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import logging

import pytest

from fntrain.config import ConfigError
from fntrain.data.preference import PreferenceDataConfig, build_preference_datasets, tokenize_pair
from tests.data.test_preference import TEMPLATE, TEXT_ROWS, USER
from tests.helpers.files import write_jsonl
from tests.helpers.model_assets import Assets


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"path": 3}, "data.path must be a str, got 3"),
        ({"prompt_key": ""}, "data.prompt_key must not be empty"),
        ({"chosen_key": None}, "data.chosen_key must be a str, got None"),
        ({"rejected_key": ""}, "data.rejected_key must not be empty"),
        ({"pad_multiple": 0}, "data.pad_multiple must be >= 1, got 0"),
        ({"pad_multiple": 1.5}, "data.pad_multiple must be an int, got 1.5"),
        ({"rejected_key": "chosen"},
         "data.prompt_key, data.chosen_key and data.rejected_key must differ, got 'prompt', 'chosen' and 'chosen'"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_refused_naming_the_flag_and_value(tmp_path, changes, message):
    path = write_jsonl(tmp_path / "pairs.jsonl", TEXT_ROWS)
    with pytest.raises((ValueError, TypeError)) as error:
        PreferenceDataConfig(**{"path": path, **changes}).validate()
    assert str(error.value) == message


def test_a_validation_file_that_does_not_exist_is_refused_before_any_row_is_read(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", TEXT_ROWS)
    missing = str(tmp_path / "val.jsonl")
    with pytest.raises(ConfigError, match=f"^data.val_path {missing!r} does not exist"):
        PreferenceDataConfig(path=path, val_path=missing).validate()


def test_an_index_past_the_last_pair_is_refused_naming_the_count():
    from fntrain.data.preference import PreferenceExamples, PreferencePair

    examples = PreferenceExamples([PreferencePair((1,), (2,), (3,)), PreferencePair((1,), (4,), (5,))], 8)
    assert examples[1]["index"] == 1
    for index in (2, -1):
        with pytest.raises(IndexError) as error:
            examples[index]
        assert str(error.value) == f"index {index} out of range for 2 preference pairs"


# ----------------------------------------------------------------------------- rows


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text=text)["input_ids"]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": USER, "chosen": {"role": "assistant"}, "rejected": "b"},
         "row 1: 'chosen' must be a non-empty list of messages after a chat prompt, got dict (data.chosen_key)"),
        ({"prompt": USER, "chosen": "a", "rejected": [{"content": "b"}]},
         "row 1: 'rejected' message 0 must be an object with 'role' and 'content' (data.rejected_key)"),
        ({"prompt": [{"content": "Who?"}], "chosen": "a", "rejected": "b"},
         "row 1: 'prompt' message 0 must be an object with 'role' and 'content' (data.prompt_key)"),
    ],
)  # fmt: skip
def test_a_bad_chat_row_is_refused_naming_the_key_and_what_it_holds(assets, row, message):
    with pytest.raises(ConfigError) as error:
        tokenize_pair(row, assets, PreferenceDataConfig(path="unused"), "row 1")
    assert str(error.value) == message


def test_the_tokenizers_own_eos_token_ends_a_text_completion_whatever_the_assets_eos_id(assets):
    """As TRL: the tokenizer's eos_token string is appended, also when the assets name another EOS id (or
    none)."""
    tokenizer = assets.tokenizer
    row = {"prompt": "the sky is", "chosen": " blue", "rejected": " green"}
    expected = _ids(tokenizer, "the sky is blue</s>")
    for eos_id in (tokenizer.pad_token_id, None):
        other = Assets(tokenizer, tokenizer.pad_token_id, eos_id, TEMPLATE)
        pair = tokenize_pair(row, other, PreferenceDataConfig(path="unused"))
        assert list(pair.prompt_ids + pair.chosen_ids) == expected, eos_id


class WithoutEosToken:
    """A tokenizer that names no eos_token string (only the id's token, through convert_ids_to_tokens)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name == "eos_token":
            raise AttributeError(name)
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


def test_without_an_eos_token_string_the_assets_eos_id_gives_it(assets):
    tokenizer = WithoutEosToken(assets.tokenizer)
    pair = tokenize_pair(TEXT_ROWS[0], Assets(tokenizer, assets.pad_id, assets.eos_id, TEMPLATE),
                         PreferenceDataConfig(path="unused"))  # fmt: skip
    assert list(pair.prompt_ids + pair.chosen_ids) == _ids(assets.tokenizer, "the sky is blue</s>")
    with pytest.raises(
        ConfigError, match="row: plain-text completions end with the EOS token, and the tokenizer has none"
    ):
        tokenize_pair(
            TEXT_ROWS[0],
            Assets(tokenizer, assets.pad_id, None, TEMPLATE),
            PreferenceDataConfig(path="unused"),
        )


class ChatTemplateDefaultsOfTransformers4:
    """apply_chat_template with transformers 4's defaults: token ids, as a plain list unless return_dict=True."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, tokenize=True, return_dict=False, add_generation_prompt=False):
        encoded = self._tokenizer.apply_chat_template(
            messages, tokenize=tokenize, return_dict=True, add_generation_prompt=add_generation_prompt
        )
        return encoded if return_dict else encoded["input_ids"]


def test_chat_rows_tokenize_alike_under_transformers_4s_chat_template_defaults(assets):
    row = {"prompt": USER, "chosen": "blue", "rejected": "green"}
    data = PreferenceDataConfig(path="unused")
    older = Assets(
        ChatTemplateDefaultsOfTransformers4(assets.tokenizer), assets.pad_id, assets.eos_id, TEMPLATE
    )
    assert tokenize_pair(row, older, data) == tokenize_pair(row, assets, data)


def test_a_pair_that_exactly_fills_max_length_is_not_counted_as_truncated(assets, tmp_path):
    row = TEXT_ROWS[0]
    pair = tokenize_pair(row, assets, PreferenceDataConfig(path="unused"))
    longest = len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))
    path = write_jsonl(tmp_path / "pairs.jsonl", [row])
    for max_length, truncated in ((longest, 0), (longest - 1, 1)):
        train, _ = build_preference_datasets(PreferenceDataConfig(path=path, max_length=max_length), assets)
        assert train.truncated == truncated, max_length


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("missing", ["prompt", "chosen", "rejected"])
def test_a_table_without_a_column_is_refused_naming_the_setting_of_each_column(assets, tmp_path, missing):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {key: value for key, value in TEXT_ROWS[0].items() if key != missing}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "t.parquet")
    path = str(tmp_path / "t.parquet")
    with pytest.raises(ConfigError) as error:
        build_preference_datasets(PreferenceDataConfig(path=path), assets)
    assert str(error.value) == (
        f"data.path {path!r}: cannot tell the format of its rows, with columns {sorted(row)}: data.{missing}_key "
        f"{missing!r} is not among them; expected data.prompt_key 'prompt' + data.chosen_key 'chosen' + "
        "data.rejected_key 'rejected'"
    )


def test_the_log_counts_the_rows_cut_and_the_rows_whose_prompt_merges_into_the_completion(
    assets, tmp_path, caplog
):
    long = {"prompt": "hello", "chosen": " the sky is blue" * 4, "rejected": " no"}
    merged = {"prompt": "the sk", "chosen": "y is blue", "rejected": "y is green"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [long, merged, TEXT_ROWS[0]])
    with caplog.at_level(logging.WARNING, logger="fntrain.data.preference"):
        build_preference_datasets(PreferenceDataConfig(path=path, max_length=8), assets)
    assert [record.getMessage() for record in caplog.records] == [
        f"data.path {path!r}: 1 of 3 rows truncated to data.max_length 8 (keep_start: the end of the longer "
        "sequences is cut)",
        f"data.path {path!r}: in 1 of 3 rows the tokenized prompt is not a prefix of prompt + completion (the chat "
        "template renders it differently, or tokens merge across the boundary); the completion starts where they "
        "diverge, as in TRL",
    ]


def test_rows_that_fit_and_share_their_prompt_log_nothing(assets, tmp_path, caplog):
    path = write_jsonl(tmp_path / "pairs.jsonl", TEXT_ROWS)
    with caplog.at_level(logging.WARNING, logger="fntrain.data.preference"):
        train, val = build_preference_datasets(PreferenceDataConfig(path=path), assets)
    assert caplog.records == [] and len(train) == 3 and val is None


def _refusal(assets, row, **settings) -> str:
    with pytest.raises(ConfigError) as error:
        tokenize_pair(row, assets, PreferenceDataConfig(path="unused", **settings), "row 1")
    return str(error.value)


def test_a_pair_that_prefers_nothing_is_refused_naming_both_keys(assets):
    same_chat = {"prompt": USER, "chosen": "blue", "rejected": [{"role": "assistant", "content": "blue"}]}
    assert _refusal(assets, same_chat) == (
        "row 1: chosen and rejected are the same, so the pair prefers nothing (check data.chosen_key and "
        "data.rejected_key)"
    )
    same_ids = {"prompt": "a", "chosen": "b</s>", "rejected": "b"}
    assert _refusal(assets, same_ids) == (
        "row 1: chosen and rejected tokenize to the same ids, so the pair prefers nothing (check data.chosen_key "
        "and data.rejected_key)"
    )


def test_a_text_rejected_of_another_type_is_refused_naming_its_key(assets):
    row = {"prompt": "a", "chosen": "b", "rejected": 3}
    assert (
        _refusal(assets, row)
        == "row 1: 'rejected' must be a string after a text prompt, got int (data.rejected_key)"
    )


@pytest.mark.parametrize("failing", ["chosen", "rejected"])
def test_a_template_failing_on_one_completion_names_the_row(failing):
    from tests.data.test_preference import tiny_tokenizer

    template = (
        "{% for m in messages %}{% if m['content'] == 'bad' %}{{ raise_exception('bad turn') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    tokenizer = tiny_tokenizer(chat_template=template)
    assets = Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, template)
    row = {"prompt": USER, "chosen": "good", "rejected": "good", failing: "bad"}
    assert _refusal(assets, row) == "row 1: the chat template fails on this conversation (bad turn)"


def test_a_chosen_reply_the_template_does_not_render_is_refused_naming_its_key():
    from tests.data.test_preference import tiny_tokenizer

    template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or m['content'] == 'shown' %}{{ m['content'] }}"
        "{% endif %}{% endfor %}"
    )
    tokenizer = tiny_tokenizer(chat_template=template)
    assets = Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, template)
    row = {"prompt": USER, "chosen": "hidden", "rejected": "shown"}
    assert _refusal(assets, row) == "row 1: data.chosen_key gives no completion token after the prompt"


def test_max_length_is_a_limit_both_on_the_prompt_and_under_truncation_error(assets):
    """A prompt of exactly max_length tokens leaves no room; a sequence of exactly max_length fits."""
    row = TEXT_ROWS[0]
    pair = tokenize_pair(row, assets, PreferenceDataConfig(path="unused"))
    prompt, chosen = len(pair.prompt_ids), len(pair.prompt_ids) + len(pair.chosen_ids)
    rejected = len(pair.prompt_ids) + len(pair.rejected_ids)
    assert _refusal(assets, row, max_length=prompt) == (
        f"row 1: the prompt takes {prompt} tokens, leaving no room for a completion within data.max_length {prompt} "
        "(shorten the prompt or raise data.max_length)"
    )
    longest = max(chosen, rejected)
    tokenize_pair(row, assets, PreferenceDataConfig(path="unused", max_length=longest, truncation="error"))
    long_rejected = {**row, "rejected": row["rejected"] + " and green and blue"}
    longer = (
        len(tokenize_pair(long_rejected, assets, PreferenceDataConfig(path="unused")).rejected_ids) + prompt
    )
    assert _refusal(assets, long_rejected, max_length=longest, truncation="error") == (
        f"row 1: prompt + rejected takes {longer} tokens, more than data.max_length {longest} "
        "(data.truncation 'error'; keep_start would cut it)"
    )


def test_an_empty_eos_token_is_no_eos_token(assets):
    class EmptyEos(WithoutEosToken):
        eos_token = ""

    tokenizer = EmptyEos(assets.tokenizer)
    with pytest.raises(ConfigError) as error:
        tokenize_pair(TEXT_ROWS[0], Assets(tokenizer, assets.pad_id, None, TEMPLATE), PreferenceDataConfig(path="x"))
    assert str(error.value) == (
        "row: plain-text completions end with the EOS token, and the tokenizer has none; set its eos_token"
    )
