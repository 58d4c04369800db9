"""The same data through every input path (issue 49, item 3): the same SFT, chat, preference and GRPO
rows given as JSONL, gzipped JSONL, Parquet, a folder of Parquet files, an Arrow file and a
`datasets.save_to_disk` folder, and the same vocabulary brought as each kind of tokenizer directory,
give the same batches through the recipes' own data path (`fntrain.run.checks.read_inputs`: the
recipe's assets, datasets and collate, as a run reads them): the same ids, attention masks, labels
(which tokens are masked as prompt), chosen/rejected rows and prompt ids.

Where two paths cannot agree, fntrain refuses: a preference row without a prompt (TRL's implicit
prompt), a file of JSON or CSV rows. The byte vocabulary's slow and fast tokenizers differ on one thing
of their own (ByT5Tokenizer adds no EOS to a text that already ends with it), which the DPO comparison
leaves out. Everything here is built in the test: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

from fntrain.config import ConfigError  # noqa: E402
from fntrain.data.shard_index import read_index  # noqa: E402
from fntrain.data.tokenize import tokenize_files  # noqa: E402
from fntrain.data.tokens import IGNORE_INDEX  # noqa: E402
from fntrain.models.hf_config import AssetsConfig, HFModelConfig  # noqa: E402
from fntrain.models.tokenizer_files import write_byte_tokenizer  # noqa: E402
from fntrain.run.checks import read_inputs  # noqa: E402
from recipes import dpo, grpo, hf_causal_lm  # noqa: E402
from tests.data.test_preference import TEMPLATE, USER, tiny_tokenizer  # noqa: E402
from tests.data.test_tokenize import stream_of  # noqa: E402
from tests.helpers.files import write_row_formats  # noqa: E402
from tests.helpers.hf import CHATS, save_byte_tokenizer_pair, save_tokenizer_kinds  # noqa: E402

MAX_POSITIONS = 1024

SFT_ROWS = [
    {"text": "the sky is blue"},
    {"prompt": "what color is the sky?", "completion": " blue"},
    {"messages": CHATS[0]},
    {"prompt": "hello", "completion": " there, friend"},
    {"messages": CHATS[1]},
    {"text": "the sea is green, é!"},
]
"""Each SFT format, mixed in one file (a table's cells are null where a row has no such key)."""

PREFERENCE_TEXT_ROWS = [
    {"prompt": "the sky is", "chosen": " blue", "rejected": " green"},
    {"prompt": "hello", "chosen": " there, friend", "rejected": " there"},
    {"prompt": "the sea is", "chosen": " green", "rejected": " blue, é"},
]
PREFERENCE_CHAT_ROWS = [
    {"prompt": USER, "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "Green."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, *USER],
     "chosen": [{"role": "assistant", "content": "Blue, by day."}], "rejected": [{"role": "assistant", "content": "Red."}]},
    {"prompt": CHATS[1][:4], "chosen": [{"role": "assistant", "content": "La."}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]  # fmt: skip
PROMPT_TEXT_ROWS = [
    {"prompt": "what color is the sky?", "answer": "blue", "level": 1},
    {"prompt": "the sea is", "answer": "green", "level": None},
    {"prompt": "hello there", "answer": "friend", "level": 3},
]
PROMPT_CHAT_ROWS = [{"prompt": row["prompt"], "answer": "blue"} for row in PREFERENCE_CHAT_ROWS]


# ----------------------------------------------------------------------------- the recipes' data path


def input_config(recipe: Any, data: Any, model: str, tokenizer_path: str | None = None,
              chat_template: str | None = None) -> Any:  # fmt: skip
    return recipe.spec.config(
        model=HFModelConfig(path=model),
        assets=AssetsConfig(tokenizer_path=tokenizer_path, chat_template=chat_template),
        data=data,
    )


def input_batches(recipe: Any, data: Any, **where: Any) -> dict[str, Any]:
    """What a run of `recipe` reads: every train and validation sample through the recipe's collate, in
    micro-batches of two, as lists; and for GRPO each prompt row's ids, prompt and reward columns."""
    inputs = read_inputs(input_config(recipe, data, **where), recipe.spec)
    read: dict[str, Any] = {"pad_id": inputs.assets.pad_id}
    for split, dataset in (("train", inputs.train_set), ("val", inputs.val_set)):
        samples = [] if dataset is None else [dataset[i] for i in range(len(dataset))]
        micro = [inputs.collate_fn(samples[i : i + 2]) for i in range(0, len(samples), 2)]
        read[split] = [
            [(row.prompt_ids, row.prompt, row.columns) for row in batch] if isinstance(batch, list)
            else {key: value.tolist() for key, value in batch.items()}
            for batch in micro
        ]  # fmt: skip
    return read


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, dict]:
    """The tiny chat tokenizer of tests/data/test_preference.py, saved in every kind of directory."""
    tokenizer = tiny_tokenizer()
    return save_tokenizer_kinds(tmp_path_factory.mktemp("kinds"), tokenizer, vocab_size=len(tokenizer),
                                max_positions=MAX_POSITIONS)  # fmt: skip


@pytest.fixture(scope="module")
def byte_kinds(tmp_path_factory) -> dict[str, dict]:
    return save_byte_tokenizer_pair(tmp_path_factory.mktemp("bytes"), TEMPLATE.replace("{{ bos_token }}", ""),
                                    max_positions=MAX_POSITIONS)  # fmt: skip


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("rows")
    rows = {"sft": SFT_ROWS, "preference_text": PREFERENCE_TEXT_ROWS, "preference_chat": PREFERENCE_CHAT_ROWS,
            "prompt_text": PROMPT_TEXT_ROWS, "prompt_chat": PROMPT_CHAT_ROWS}  # fmt: skip
    return {name: write_row_formats(root / name, data) for name, data in rows.items()}


FIRST = "tokenizer.json + chat_template.jinja"


def decode(kinds: dict, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kinds[FIRST]["tokenizer_path"]).decode(ids)


def trained_ids(ids: list[int], labels: list[int]) -> list[int]:
    return [token for token, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]


# ----------------------------------------------------------------------------- SFT and chat rows


def sft_data_config(path: str, packing: bool) -> hf_causal_lm.DataConfig:
    return hf_causal_lm.DataConfig(path=path, max_length=128, packing=packing, val_fraction=0.2)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_and_chat_rows_give_the_same_batches_from_every_format(sources, kinds, packing):
    read = {name: input_batches(hf_causal_lm, sft_data_config(path, packing), **kinds[FIRST])
            for name, path in sources["sft"].items()}  # fmt: skip
    assert all(read[name] == read["jsonl"] for name in read), [n for n in read if read[n] != read["jsonl"]]
    first = read["jsonl"]["train"][0]
    if not packing:  # row 0 is a text row, trained on every token; row 1 a prompt/completion pair
        assert decode(kinds, trained_ids(first["input_ids"][0], first["labels"][0])) == "<s>the sky is blue</s>"
        assert decode(kinds, trained_ids(first["input_ids"][1], first["labels"][1])) == " blue</s>"
        assert first["attention_mask"][0] != first["attention_mask"][1]  # the shorter row is padded
        chat = read["jsonl"]["train"][1]
        assert decode(kinds, trained_ids(chat["input_ids"][0], chat["labels"][0])) == "A king.</s>\n"
    assert len(read["jsonl"]["val"]) == 1  # the last row, held out


def test_sft_and_chat_rows_give_the_same_batches_through_every_kind_of_tokenizer(sources, kinds):
    path = sources["sft"]["parquet"]
    read = {name: input_batches(hf_causal_lm, sft_data_config(path, False), **where) for name, where in kinds.items()}
    assert all(read[name] == read[FIRST] for name in read), [n for n in read if read[n] != read[FIRST]]
    chat = read[FIRST]["train"][2]  # the five-turn chat: two assistant turns trained, the rest masked
    assert decode(kinds, trained_ids(chat["input_ids"][0], chat["labels"][0])) == "Well met.</s>\nLa la.</s>\n"


def test_a_slow_and_a_fast_tokenizer_of_one_vocabulary_give_the_same_sft_batches(sources, byte_kinds):
    """ByT5Tokenizer has no offsets, so prompt masking tokenizes the prompt and the completion apart; the
    EOS it adds to a text must still come at the end, where the fast tokenizer puts it."""
    path = sources["sft"]["jsonl"]
    slow, fast = (input_batches(hf_causal_lm, sft_data_config(path, False), **where) for where in byte_kinds.values())
    assert slow == fast
    pair = fast["train"][0]  # row 1: "what color is the sky?" + " blue" and one </s> (1), the tokenizer's, trained
    length = sum(pair["attention_mask"][1])
    assert pair["input_ids"][1][length - 6 : length] == [35, 101, 111, 120, 104, 1]
    assert trained_ids(pair["input_ids"][1], pair["labels"][1]) == [35, 101, 111, 120, 104, 1]


# ----------------------------------------------------------------------------- preference rows (DPO)


def preference_data(path: str) -> Any:
    return dpo.spec.config().data.__class__(path=path, max_length=128, val_fraction=0.34)


@pytest.mark.parametrize("rows", ["preference_text", "preference_chat"])
def test_preference_rows_give_the_same_chosen_and_rejected_batches_from_every_format(sources, kinds, rows):
    read = {name: input_batches(dpo, preference_data(path), **kinds[FIRST]) for name, path in sources[rows].items()}
    assert all(read[name] == read["jsonl"] for name in read), [n for n in read if read[n] != read["jsonl"]]
    batch = read["jsonl"]["train"][0]  # rows 0 and 1: chosen 0, chosen 1, rejected 0, rejected 1
    ends = {
        "preference_text": [" blue</s>", " green</s>"],
        "preference_chat": ["Blue.</s>\n", "Green.</s>\n"],
    }
    assert [decode(kinds, trained_ids(batch["input_ids"][i], batch["labels"][i])) for i in (0, 2)] == ends[rows]
    assert len(read["jsonl"]["val"]) == 1


@pytest.mark.parametrize("rows", ["preference_text", "preference_chat"])
def test_preference_rows_give_the_same_batches_through_every_kind_of_tokenizer(
    sources, kinds, byte_kinds, rows
):
    path = sources[rows]["arrow"]
    read = {name: input_batches(dpo, preference_data(path), **where) for name, where in kinds.items()}
    assert all(read[name] == read[FIRST] for name in read), [n for n in read if read[n] != read[FIRST]]
    if rows == "preference_chat":  # text rows get "</s>" appended, to which ByT5 adds no second EOS
        slow, fast = (input_batches(dpo, preference_data(path), **where) for where in byte_kinds.values())
        assert slow == fast


def test_a_preference_row_without_a_prompt_is_refused_naming_the_setting(tmp_path, kinds):
    """TRL also reads conversational rows whose prompt is only the shared start of chosen and rejected;
    fntrain needs the prompt in its own column, and says so in one line, whatever the format."""
    rows = [{"chosen": CHATS[0], "rejected": [CHATS[0][0], {"role": "assistant", "content": "A fool."}]}] * 2
    paths = write_row_formats(tmp_path, rows)
    for path in (paths["jsonl"], paths["parquet"]):
        with pytest.raises(ConfigError) as refused:
            input_batches(dpo, preference_data(path), **kinds[FIRST])
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and f"data.path {path!r}" in message, message
        assert "data.prompt_key 'prompt'" in message or "check data.prompt_key" in message, message


# ----------------------------------------------------------------------------- GRPO prompts


@pytest.mark.parametrize("rows", ["prompt_text", "prompt_chat"])
def test_grpo_prompts_are_the_same_from_every_format_and_every_kind_of_tokenizer(
    sources, kinds, byte_kinds, rows
):
    read = {name: input_batches(grpo, grpo.PromptDataConfig(path=path), **kinds[FIRST])
            for name, path in sources[rows].items()}  # fmt: skip
    read.update({kind: input_batches(grpo, grpo.PromptDataConfig(path=sources[rows]["parquet"]), **where)
                 for kind, where in kinds.items()})  # fmt: skip
    assert all(read[name] == read["jsonl"] for name in read), [n for n in read if read[n] != read["jsonl"]]
    first_ids, first_prompt, columns = read["jsonl"]["train"][0][0]
    expected = "<s>what color is the sky?" if rows == "prompt_text" else \
        "<s><|user|>\nWhat color is the sky?</s>\n<|assistant|>\n"  # fmt: skip
    assert decode(kinds, list(first_ids)) == expected
    assert columns == ({"answer": "blue", "level": 1} if rows == "prompt_text" else {"answer": "blue"})
    slow, fast = (input_batches(grpo, grpo.PromptDataConfig(path=sources[rows]["jsonl"]), **where)
                  for where in byte_kinds.values())  # fmt: skip
    assert slow["train"] == fast["train"]


# ----------------------------------------------------------------------------- formats fntrain does not read


@pytest.mark.parametrize("name, content", [
    ("rows.csv", "prompt,completion\nthe sky is, blue\n"),
    ("rows.json", json.dumps(SFT_ROWS[:2], indent=1)),
    ("rows-one-line.json", json.dumps(SFT_ROWS[:2])),
], ids=["csv", "json-array", "json-array-on-one-line"])  # fmt: skip
def test_csv_and_json_array_files_are_refused_in_one_line_naming_the_file(tmp_path, kinds, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError) as refused:
        input_batches(hf_causal_lm, sft_data_config(str(path), False), **kinds[FIRST])
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"data.path {str(path)!r} line 1:"), message


# ----------------------------------------------------------------------------- `fntrain tokenize` (plain text)

TEXT_ROWS = [
    {"text": text} for text in ("the sky is blue", "hello there, friend", "the sea is green, é!", "Well met.")
]


def shards_of(output: Path) -> tuple[list[int], bytes, int, int]:
    """What a run on the shards reads: the token stream, the document starts, the EOS id, the vocabulary."""
    index = read_index(output)
    return stream_of(output), (output / "documents.bin").read_bytes(), index.eos_id, index.vocab_size


def test_fntrain_tokenize_writes_the_same_shards_from_every_format_and_kind_of_tokenizer(tmp_path, kinds):
    """`tokenize_files` (what `fntrain tokenize` runs): fntrain's `bytes` and the byte tokenizer directory a
    tiny GPT exports (`write_byte_tokenizer`) are one vocabulary; so are the tiny BPE's tokenizer.json and
    vocab.json + merges.txt directories."""
    sources = write_row_formats(tmp_path / "rows", TEXT_ROWS)
    write_byte_tokenizer(tmp_path / "bytes-dir", eos_id=256)
    families = {
        "bytes": {"bytes": "bytes", "byte tokenizer directory": str(tmp_path / "bytes-dir")},
        "bpe": {kind: kinds[kind]["tokenizer_path"] for kind in (FIRST, "vocab.json + merges.txt")},
    }
    for family, tokenizers in families.items():
        written = {}
        for source, path in sources.items():
            for kind, tokenizer in tokenizers.items():
                output = tmp_path / family / kind.replace(" ", "-") / source
                tokenize_files([path], output, tokenizer)
                written[source, kind] = shards_of(output)
        first = next(iter(written.values()))
        assert all(value == first for value in written.values()), [
            k for k, v in written.items() if v != first
        ]
        stream, _, eos, _ = first
        assert stream.count(eos) == len(TEXT_ROWS) and stream[-1] == eos
        if family == "bytes":
            assert stream[: len(b"the sky is blue") + 1] == [*b"the sky is blue", 256]
        else:  # each document without special tokens, then EOS
            assert decode(kinds, stream) == "".join(row["text"] + "</s>" for row in TEXT_ROWS)
