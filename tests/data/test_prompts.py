"""GRPO's prompt data (fntrain.data.prompts): prompts tokenized as TRL 1.16's GRPOTrainer tokenizes them
(plain text with the tokenizer's special tokens, chat messages through the template with its generation
prompt), every other column kept for the reward functions, JSONL, Parquet and save_to_disk alike, and
every bad row one ConfigError naming the flag, the file and the row."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fntrain.config import ConfigError
from fntrain.data.prompts import (
    PromptDataConfig,
    PromptRow,
    build_prompt_dataset,
    collate_prompts,
    longest_prompt,
    tokenize_prompt,
)
from tests.data.test_preference import tiny_tokenizer
from tests.helpers.files import write_jsonl
from tests.helpers.model_assets import Assets

USER = [{"role": "user", "content": "What color is the sky?"}]
ROWS = [
    {"prompt": "the sky is", "answer": "#### 4", "meta": {"level": 1, "tags": ["a"]}, "completion": "dropped"},
    {"prompt": "what color is the sea?", "answer": 72, "meta": {"level": 2, "tags": []}},
    {"prompt": "hello there", "answer": None, "meta": {"level": 3, "tags": ["b", "c"]}, "note": "only here"},
]


def items(dataset: Any) -> list[tuple[Any, ...]]:
    return [(r.index, r.prompt, r.prompt_ids, r.columns) for r in (dataset[i] for i in range(len(dataset)))]


# ----------------------------------------------------------------------------- rows and tokenization


def test_text_prompts_are_tokenized_with_special_tokens_and_keep_their_columns(assets, tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    prompts = build_prompt_dataset(PromptDataConfig(path=path), assets)
    assert len(prompts) == 3 and not prompts.conversational
    first = prompts[0]
    assert first.index == 0 and first.prompt == "the sky is" and first.where == f"data.path {path!r} line 1"
    assert list(first.prompt_ids) == assets.tokenizer(text="the sky is")["input_ids"]
    assert first.prompt_ids[0] == assets.tokenizer.bos_token_id  # the tokenizer's special tokens, as TRL
    # every column but the prompt (and TRL's completion/completion_ids), a column some rows lack as None
    assert first.columns == {"answer": "#### 4", "meta": {"level": 1, "tags": ["a"]}, "note": None}
    assert prompts[1].columns == {"answer": 72, "meta": {"level": 2, "tags": []}, "note": None}
    assert prompts[2].columns == {"answer": None, "meta": {"level": 3, "tags": ["b", "c"]}, "note": "only here"}
    assert prompts[2].where == f"data.path {path!r} line 3"


def test_chat_prompts_go_through_the_template_with_the_generation_prompt(assets, tmp_path):
    system = [{"role": "system", "content": "Be brief."}, *USER]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": USER, "answer": "blue"}, {"prompt": system, "answer": 1}])
    prompts = build_prompt_dataset(PromptDataConfig(path=path), assets)
    assert prompts.conversational and prompts[0].conversational and prompts[1].prompt == system
    expected = assets.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert list(prompts[0].prompt_ids) == expected["input_ids"]
    decoded = assets.tokenizer.decode(prompts[1].prompt_ids)
    assert decoded == "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat color is the sky?</s>\n<|assistant|>\n"


def test_jsonl_gzip_parquet_and_save_to_disk_give_the_same_items(assets, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"question": USER, "answer": "#### 4", "level": 1, "tests": ["assert f(1) == 2"]},
        {"question": [{"role": "user", "content": "hello there"}], "answer": "7", "level": 2, "tests": []},
        {"question": USER, "answer": "1,234", "level": None, "tests": ["x", "y"]},
    ]
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    with gzip.open(tmp_path / "p.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write(Path(jsonl).read_text())
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    sources = [jsonl, str(tmp_path / "p.jsonl.gz"), str(tmp_path / "p.parquet"), str(tmp_path / "saved")]
    built = [build_prompt_dataset(PromptDataConfig(path=source, prompt_key="question"), assets) for source in sources]
    assert all(items(other) == items(built[0]) for other in built[1:])
    assert built[0][2].columns == {"answer": "1,234", "level": None, "tests": ["x", "y"]}
    assert built[2][1].where == f"data.path {sources[2]!r} row 1"  # a table's rows: 0-based, as datasets


def test_collate_longest_and_indexing(assets, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "the sky is blue, the sea is"}, {"prompt": "b"}])
    prompts = build_prompt_dataset(PromptDataConfig(path=path), assets)
    assert longest_prompt(prompts) == (len(prompts[1].prompt_ids), f"data.path {path!r} line 2")
    assert longest_prompt([prompts[0], prompts[2]]) == (len(prompts[0].prompt_ids), f"data.path {path!r} line 1")
    batch = collate_prompts([prompts[2], prompts[0]])
    assert batch == [prompts[2], prompts[0]] and all(isinstance(row, PromptRow) for row in batch)
    with pytest.raises(IndexError, match="index 3 out of range for 3 prompts"):
        prompts[3]


def test_validate_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    PromptDataConfig(path=path).validate()
    with pytest.raises(ValueError, match="data.path is required"):
        PromptDataConfig().validate()
    with pytest.raises(ConfigError, match=r"data.path '.*nope.jsonl' does not exist"):
        PromptDataConfig(path=str(tmp_path / "nope.jsonl")).validate()
    with pytest.raises(ValueError, match="data.prompt_key must not be empty"):
        PromptDataConfig(path=path, prompt_key="").validate()
    with pytest.raises(TypeError, match="grpo_data.prompt_key must be a str"):
        PromptDataConfig(path=path, prompt_key=3).validate("grpo_data")


# ----------------------------------------------------------------------------- bad rows


BAD_ROWS = [
    ({"question": "a"}, r"line 2: missing key 'prompt' \(the row has keys \['question'\]\): check data.prompt_key"),
    ({"prompt": None}, r"line 2: 'prompt' must be a string or a list of chat messages, got NoneType \(data.prompt_key\)"),
    ({"prompt": 3}, r"line 2: 'prompt' must be a string or a list of chat messages, got int"),
    ({"prompt": ""}, r"line 2: 'prompt' is an empty string \(data.prompt_key\)"),
    ({"prompt": []}, r"line 2: 'prompt' is an empty list of messages \(data.prompt_key\)"),
    ({"prompt": [{"role": "user"}]}, r"line 2: 'prompt' message 0 must be an object with 'role' and 'content'"),
    ({"prompt": ["hi"]}, r"line 2: 'prompt' message 0 must be an object with 'role' and 'content'"),
    ({"prompt": USER}, r"line 2: the prompt is chat messages, but the first row's \(data.path .* line 1\) is plain text: all prompts must be of one kind"),
    ({"prompt": "b", "completions": [1]}, r"line 2: column 'completions' would reach the reward functions as the keyword completions=, which the trainer sets itself"),
    ({"prompt": "b", "trainer_state": 1}, r"line 2: column 'trainer_state' would reach"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "message"), BAD_ROWS)
def test_bad_row_is_one_config_error_naming_file_and_row(assets, tmp_path, row, message):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the sky is"}, row])
    with pytest.raises(ConfigError, match=f"^data.path {path!r} " + message) as error:
        build_prompt_dataset(PromptDataConfig(path=path), assets)
    assert "\n" not in str(error.value)


def test_bad_sources(assets, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"^data.path '.*empty.jsonl' is empty"):
        build_prompt_dataset(PromptDataConfig(path=str(empty)), assets)
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "1"}]), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match=r"^data.path '.*t.parquet': .*expected data.prompt_key 'prompt'"):
        build_prompt_dataset(PromptDataConfig(path=str(tmp_path / "t.parquet")), assets)
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), tmp_path / "null.parquet")
    with pytest.raises(ConfigError, match=r"^data.path '.*null.parquet' row 1: missing key 'prompt'"):
        build_prompt_dataset(PromptDataConfig(path=str(tmp_path / "null.parquet")), assets)


def test_chat_prompts_need_a_working_template(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": USER}])
    tokenizer = tiny_tokenizer(chat_template=None)
    bare = Assets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, None)
    with pytest.raises(ConfigError, match=r"line 1: a prompt of chat messages needs a chat template.*assets.chat_template"):
        build_prompt_dataset(PromptDataConfig(path=path), bare)
    failing = tiny_tokenizer(chat_template="{{ raise_exception('no user turns') }}")
    broken = Assets(failing, failing.pad_token_id, failing.eos_token_id, "x")
    with pytest.raises(ConfigError, match=r"line 1: the chat template fails on this prompt \(no user turns\)"):
        build_prompt_dataset(PromptDataConfig(path=path), broken)


@dataclass(frozen=True)
class _Silent:
    """A tokenizer that gives no token for anything."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": []}


def test_a_prompt_with_no_token_is_refused():
    assets = Assets(_Silent(), 0, None, None)
    with pytest.raises(ConfigError, match=r"^row 5: the prompt gives no token \(data.prompt_key 'q'\)$"):
        tokenize_prompt("   ", assets, "row 5", key="q")


# ----------------------------------------------------------------------------- TRL's own tokenization


@pytest.mark.slow
def test_ids_are_grpo_trainers(assets):
    """GRPOTrainer._tokenize_prompts itself (unbound, on the attributes it reads) gives the same ids."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = SimpleNamespace(processing_class=assets.tokenizer, _is_vlm=False, environment_factories=None,
                              tools=None, chat_template=None, chat_template_kwargs={})  # fmt: skip
    for batch in (["the sky is", "hello there, friend"], [USER, [{"role": "user", "content": "hi"}, *USER]]):
        ids, _, _ = GRPOTrainer._tokenize_prompts(trainer, batch)
        assert [list(tokenize_prompt(prompt, assets, "row")) for prompt in batch] == [list(i) for i in ids]
