"""Prompts for GRPO: rows holding a prompt (plain text, or chat messages) and whatever else the reward
functions read (an answer, test cases), each tokenized as TRL 1.16's GRPOTrainer tokenizes it.

    data = PromptDataConfig(path="prompts.jsonl")
    data.validate()                                   # before any model work: fields and the file
    prompts = build_prompt_dataset(data, assets)      # every row read and tokenized here
    prompts[7]    # PromptRow(index=7, prompt=..., prompt_ids=(...), columns={"answer": ...}, where=...)
    length, where = longest_prompt(prompts)           # must leave room for the completion in the context

A row is {"prompt": str} or {"prompt": [{"role", "content"}, ...]} (`data.prompt_key` names the column),
all rows of one kind, with any other columns. JSONL (.jsonl, .jsonl.gz), Parquet/Arrow files and
`datasets.save_to_disk` folders serve alike (`fntrain.data.files.read_rows`); nothing is downloaded.

Tokenization is `GRPOTrainer._tokenize_prompts`: plain text `tokenizer(text=prompt)["input_ids"]` (special
tokens added as the tokenizer adds them), chat messages `tokenizer.apply_chat_template(messages,
add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]`.

The other columns go to the reward functions as keywords, one list item per completion (TRL's convention:
every column but "prompt", "completion" and "completion_ids"; here the `data.prompt_key` column is the
prompt). A column missing from some rows (or null there) is None in them, as `datasets` reads such a file.
A column named like a keyword the trainer passes itself (REWARD_KEYWORDS) is refused: it would collide.
Every problem is a `ConfigError` naming the flag, the file as typed and the row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fntrain.config import ConfigError, first_line, require_str
from fntrain.data.files import position_label, read_rows, require_source
from fntrain.data.formats import check_table_formats
from fntrain.data.sft import TokenizerAssets

__all__ = [
    "REWARD_KEYWORDS",
    "PromptDataConfig",
    "PromptRow",
    "PromptRows",
    "tokenize_prompt",
    "build_prompt_dataset",
    "collate_prompts",
    "longest_prompt",
]

REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The keywords a reward function gets from the trainer itself; no data column may take these names."""
_NOT_PASSED = ("prompt", "completion", "completion_ids")  # TRL leaves these columns out of the keywords


@dataclass(frozen=True)
class PromptDataConfig:
    """The prompts (JSONL or a table) GRPO samples completions for, with the columns its rewards read."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path",)

    path: str = ""
    """JSONL file (.jsonl or .jsonl.gz), one {"prompt": ...} object per line with any other keys the reward functions read (e.g. "answer"); or a .parquet/.arrow file, a folder of them or a datasets.save_to_disk folder with those columns. Required."""
    prompt_key: str = "prompt"
    """Key (column) of the prompt: a string, or a list of {"role", "content"} messages (rendered with the chat template and its generation prompt)."""

    def validate(self, prefix: str = "data") -> None:
        """Value rules, each error naming `prefix.field`; the file (or table folder) must exist (a
        `ConfigError` otherwise). Its rows are read and checked by `build_prompt_dataset`."""
        require_str(f"{prefix}.path", self.path)
        if not self.path:
            raise ValueError(f"{prefix}.path is required: a JSONL file (or table) of prompts")
        require_str(f"{prefix}.prompt_key", self.prompt_key, non_empty=True)
        require_source(f"{prefix}.path", self.path)


@dataclass(frozen=True)
class PromptRow:
    """One prompt as the rollout and the reward functions see it."""

    index: int
    """Position in the dataset (what the sampler's order indexes)."""
    prompt: str | list[dict[str, Any]]
    """The prompt as read: text, or chat messages (TRL passes it to reward functions as `prompts`)."""
    prompt_ids: tuple[int, ...]
    """Its tokens, as GRPOTrainer tokenizes it."""
    columns: dict[str, Any]
    """Every other column of the row ({name: value}; None where the row has no value), for the rewards."""
    where: str
    """The row for error messages: "data.path 'prompts.jsonl' line 7" (a table's rows: "row 6", 0-based)."""

    @property
    def conversational(self) -> bool:
        """The prompt is chat messages (its completions are then assistant messages, not text)."""
        return isinstance(self.prompt, list)


class PromptRows(torch.utils.data.Dataset):
    """Map-style dataset of `PromptRow`s, all rows of one kind (text or chat); item i has index i."""

    def __init__(self, rows: Sequence[PromptRow]):
        self.rows = tuple(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        if not 0 <= index < len(self.rows):
            raise IndexError(f"index {index} out of range for {len(self.rows)} prompts")
        return self.rows[index]

    @property
    def conversational(self) -> bool:
        """The prompts are chat messages."""
        return bool(self.rows) and self.rows[0].conversational


# ----------------------------------------------------------------------------- one row


def _check_messages(value: list[Any], key: str, where: str) -> None:
    if not value:
        raise ConfigError(f"{where}: {key!r} is an empty list of messages (data.prompt_key)")
    for number, message in enumerate(value):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ConfigError(
                f"{where}: {key!r} message {number} must be an object with 'role' and 'content' "
                "(data.prompt_key)"
            )


def tokenize_prompt(prompt: Any, assets: TokenizerAssets, where: str, key: str = "prompt") -> tuple[int, ...]:
    """The token ids of one prompt (text or chat messages), as GRPOTrainer tokenizes it (see the module
    docstring). A prompt of another type, an empty one, chat without a chat template, a template that
    raises, or no token at all is a `ConfigError` starting with `where` (`key`: the prompt's column)."""
    tokenizer = assets.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(f"{where}: {key!r} is an empty string (data.prompt_key)")
        ids = list(tokenizer(text=prompt)["input_ids"])
    elif isinstance(prompt, list):
        _check_messages(prompt, key, where)
        if not assets.chat_template:
            raise ConfigError(
                f"{where}: a prompt of chat messages needs a chat template: the tokenizer has none; "
                "set assets.chat_template"
            )
        try:  # the call GRPOTrainer._tokenize_prompts makes for conversational prompts
            encoded = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as error:  # noqa: BLE001 - a template raising (jinja2's raise_exception): a data error
            raise ConfigError(
                f"{where}: the chat template fails on this prompt ({first_line(error)})"
            ) from None
        ids = list(encoded["input_ids"])
    else:
        raise ConfigError(
            f"{where}: {key!r} must be a string or a list of chat messages, got {type(prompt).__name__} "
            "(data.prompt_key)"
        )
    if not ids:
        raise ConfigError(f"{where}: the prompt gives no token (data.prompt_key {key!r})")
    return tuple(int(token) for token in ids)


def _prompt_row(
    record: Mapping[str, Any], index: int, names: Sequence[str], assets: TokenizerAssets, key: str, where: str
) -> PromptRow:
    if key not in record:
        raise ConfigError(
            f"{where}: missing key {key!r} (the row has keys {sorted(record)}): check data.prompt_key"
        )
    prompt_ids = tokenize_prompt(record[key], assets, where, key)
    return PromptRow(index, record[key], prompt_ids, {name: record.get(name) for name in names}, where)


def _column_names(rows: Sequence[tuple[int | str, Mapping[str, Any]]], key: str, source: str) -> list[str]:
    """The columns passed to the reward functions, in the order they first appear; one named like a
    trainer keyword is a `ConfigError` naming the first row that has it."""
    names: dict[str, None] = {}
    for position, record in rows:
        for name in record:
            if name in REWARD_KEYWORDS and name != key:
                raise ConfigError(
                    f"{source} {position_label(position)}: column {name!r} would reach the reward functions "
                    f"as the keyword {name}=, which the trainer sets itself: rename the column"
                )
            if name != key and name not in _NOT_PASSED:
                names.setdefault(name)
    return list(names)


def _check_one_kind(rows: Sequence[PromptRow]) -> None:
    """Text and chat prompts do not mix: the completions the rewards get would be text in some rows and
    messages in others (TRL decides the kind from the first row)."""
    for row in rows[1:]:
        if row.conversational != rows[0].conversational:
            kinds = (
                ("chat messages", "plain text") if rows[0].conversational else ("plain text", "chat messages")
            )
            raise ConfigError(
                f"{row.where}: the prompt is {kinds[1]}, but the first row's ({rows[0].where}) is "
                f"{kinds[0]}: all prompts must be of one kind"
            )


# ----------------------------------------------------------------------------- the dataset


def build_prompt_dataset(config: PromptDataConfig, assets: TokenizerAssets) -> PromptRows:
    """Every row of `config.path` read and tokenized (so a bad file or row is a `ConfigError` naming
    data.path, the file as typed and the row before any model work), in file order."""
    key = config.prompt_key
    check_table_formats("data.path", config.path, [[("data.prompt_key", key)]], 0)  # a table's columns first
    rows = read_rows(config.path, "data.path", None)
    source = f"data.path {config.path!r}"
    names = _column_names(rows, key, source)
    prompts = [
        _prompt_row(record, index, names, assets, key, f"{source} {position_label(position)}")
        for index, (position, record) in enumerate(rows)
    ]
    _check_one_kind(prompts)
    return PromptRows(prompts)


def collate_prompts(rows: Sequence[PromptRow]) -> list[PromptRow]:
    """A batch of prompts is the rows themselves, as a list: they carry no tensor, and the rollout reads
    their ids, prompts and columns."""
    return list(rows)


def longest_prompt(dataset: Sequence[PromptRow] | PromptRows) -> tuple[int, str]:
    """(tokens, where) of the dataset's longest prompt (the first of equals): what must leave room for
    the completions in the model's context."""
    longest = max((dataset[i] for i in range(len(dataset))), key=lambda row: len(row.prompt_ids))
    return len(longest.prompt_ids), longest.where
