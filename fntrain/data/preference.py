"""Preference data for DPO: rows of {prompt, chosen, rejected} -> the token ids and labels TRL's DPOTrainer
(1.16) feeds its model, one chosen and one rejected sequence per row.

    data = PreferenceDataConfig(path="pairs.jsonl", max_length=1024)
    data.validate()                                     # before any model work: fields and files
    train_set, val_set = build_preference_datasets(data, assets)
    collate = make_preference_collate(assets.pad_id, pad_multiple=data.pad_multiple)  # 2B rows, one forward

A row is plain text ({"prompt": str, "chosen": str, "rejected": str}) or conversational (the prompt a
list of {"role", "content"} messages, chosen and rejected lists of the assistant message(s) that follow;
a string there is one assistant message). JSONL (.jsonl, .jsonl.gz), Parquet/Arrow files and
`datasets.save_to_disk` folders serve alike (`fntrain.data.files.read_rows`); the key settings name the
columns. Every row is read and tokenized in `build_preference_datasets`, so a bad row is a `ConfigError`
naming the flag, the file and the row before any model work.

Tokenization follows `DPOTrainer._prepare_dataset` exactly, so a parity test can compare ids: plain text
gets the tokenizer's EOS token appended to chosen and rejected (unless they already end with it), and the
prompt, prompt+chosen and prompt+rejected are each tokenized as whole strings (`tokenizer(text=...)`,
special tokens added); conversational rows are tokenized by `tokenizer.apply_chat_template(...,
tokenize=True, return_dict=True)`, the prompt alone with the generation prompt, prompt+chosen and
prompt+rejected without (no EOS added: the template ends the turn). The completion starts at the shorter
of the common prefixes of the prompt's ids with the two sequences' ids (usually the whole prompt; a
template or a merge across the boundary can make it shorter, which is counted in the log). Labels are the
ids on completion tokens and IGNORE_INDEX on prompt tokens, unshifted (the step scores logits[:, :-1]
against labels[:, 1:]), so summed log-probs cover the completion with its EOS, as TRL sums them.

Truncation (`data.truncation`): keep_start, TRL's default, cuts each of the two sequences to its first
`max_length` tokens (the count of rows cut is logged); error refuses such rows. A prompt that alone takes
`max_length` tokens leaves no completion token and is a `ConfigError` (TRL drops such rows silently).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from fntrain.config import ConfigError, first_line, require_choice, require_int, require_str
from fntrain.data.files import held_out_tail, position_label, read_rows, require_split
from fntrain.data.formats import check_table_formats
from fntrain.data.preference_collate import make_preference_collate
from fntrain.data.sft import TokenizerAssets
from fntrain.data.tokens import IGNORE_INDEX

__all__ = [
    "TRUNCATION",
    "PreferenceDataConfig",
    "PreferencePair",
    "tokenize_pair",
    "preference_example",
    "PreferenceExamples",
    "build_preference_datasets",
    "make_preference_collate",
]

log = logging.getLogger("fntrain.data.preference")

TRUNCATION = ("keep_start", "error")


@dataclass(frozen=True)
class PreferenceDataConfig:
    """The preference pairs (JSONL or a table) for DPO and how they become chosen/rejected token sequences."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path", "val_path")

    path: str = ""
    """JSONL file (.jsonl or .jsonl.gz), one {"prompt", "chosen", "rejected"} object per line (strings, or a prompt of chat messages with chosen/rejected assistant messages); or a .parquet/.arrow file, a folder of them or a datasets.save_to_disk folder with those columns. Required."""
    prompt_key: str = "prompt"
    """Key (column) of the prompt: a string, or a list of {"role", "content"} messages."""
    chosen_key: str = "chosen"
    """Key (column) of the preferred completion: a string, or the assistant message(s) after a chat prompt."""
    rejected_key: str = "rejected"
    """Key (column) of the dispreferred completion, in the form of the chosen one."""
    max_length: int = 1024
    """Tokens per sequence (prompt + chosen, prompt + rejected, each on its own), as TRL's max_length."""
    truncation: Literal["keep_start", "error"] = "keep_start"
    """Longer sequences: keep_start (TRL's default) keeps their first max_length tokens, cutting the end of the completion, and logs how many rows were cut; error refuses such a row. A prompt that alone fills max_length is an error either way."""
    pad_multiple: int = 1
    """Pad each batch to its longest sequence rounded up to a multiple of this (1: the longest exactly, as TRL)."""
    val_path: str | None = None
    """Validation pairs for evaluation, in any form data.path takes (None: the val_fraction tail of data.path)."""
    val_fraction: float = 0.0
    """Tail fraction of data.path's rows held out for evaluation when val_path is None."""

    def validate(self, prefix: str = "data") -> None:
        """Value rules, each error naming `prefix.field`; the data files (or table folders) must exist (a
        `ConfigError` otherwise). Their rows are read and checked by `build_preference_datasets`."""
        require_str(f"{prefix}.path", self.path)
        if not self.path:
            raise ValueError(f"{prefix}.path is required: a JSONL file (or table) of preference pairs")
        for name in ("prompt_key", "chosen_key", "rejected_key"):
            require_str(f"{prefix}.{name}", getattr(self, name), non_empty=True)
        keys = {
            self.prompt_key: "prompt_key",
            self.chosen_key: "chosen_key",
            self.rejected_key: "rejected_key",
        }
        if len(keys) < 3:
            raise ValueError(
                f"{prefix}.prompt_key, {prefix}.chosen_key and {prefix}.rejected_key must differ, got "
                f"{self.prompt_key!r}, {self.chosen_key!r} and {self.rejected_key!r}"
            )
        require_int(f"{prefix}.max_length", self.max_length, min=2)
        require_choice(f"{prefix}.truncation", self.truncation, TRUNCATION)
        require_int(f"{prefix}.pad_multiple", self.pad_multiple, min=1)
        require_split(prefix, self.path, self.val_path, self.val_fraction)


@dataclass(frozen=True)
class PreferencePair:
    """One row tokenized as TRL's DPO tokenization leaves it (its "prompt_ids", "chosen_ids" and
    "rejected_ids"): prompt + chosen and prompt + rejected are the two sequences, untruncated."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    prompt_cut: bool = False
    """The tokenized prompt alone is longer than the prefix the sequences share (a template rendering it
    differently, or tokens merging across the boundary): its tail is left out, as TRL does."""


# ----------------------------------------------------------------------------- one row


def _field(record: Mapping[str, Any], key: str, setting: str, where: str) -> Any:
    if key not in record:
        raise ConfigError(
            f"{where}: missing key {key!r} (the row has keys {sorted(record)}): check data.{setting}"
        )
    return record[key]


def _messages(value: Any, key: str, setting: str, where: str) -> list[Mapping[str, Any]]:
    """A non-empty list of {"role", "content"} messages; a string stands for one assistant message."""
    if isinstance(value, str) and setting != "prompt_key":
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type(value).__name__
        raise ConfigError(
            f"{where}: {key!r} must be a non-empty list of messages after a chat prompt, got {got} (data.{setting})"
        )
    for number, message in enumerate(value):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ConfigError(
                f"{where}: {key!r} message {number} must be an object with 'role' and 'content' (data.{setting})"
            )
    return value


def _chat_ids(tokenizer: Any, messages: list[Any], generation_prompt: bool, where: str) -> list[int]:
    try:  # the call TRL's `_tokenize` makes for conversational input
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )
    except Exception as error:  # noqa: BLE001 - a user's template raising (jinja2's raise_exception) is a data error
        raise ConfigError(
            f"{where}: the chat template fails on this conversation ({first_line(error)})"
        ) from None
    return list(encoded["input_ids"])


def _eos_token(assets: TokenizerAssets, where: str) -> str:
    tokenizer = assets.tokenizer
    eos = getattr(tokenizer, "eos_token", None)
    if eos is None and assets.eos_id is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
        eos = tokenizer.convert_ids_to_tokens(assets.eos_id)
    if not isinstance(eos, str) or not eos:
        raise ConfigError(
            f"{where}: plain-text completions end with the EOS token, and the tokenizer has none; set its eos_token"
        )
    return eos


def _sequences(
    record: Mapping[str, Any], assets: TokenizerAssets, data: PreferenceDataConfig, where: str
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, prompt+chosen ids, prompt+rejected ids) of one row, as TRL tokenizes them."""
    prompt = _field(record, data.prompt_key, "prompt_key", where)
    chosen = _field(record, data.chosen_key, "chosen_key", where)
    rejected = _field(record, data.rejected_key, "rejected_key", where)
    tokenizer = assets.tokenizer
    if isinstance(prompt, list):
        if not assets.chat_template:
            raise ConfigError(
                f"{where}: rows with chat messages need a chat template: the tokenizer has none; set assets.chat_template"
            )
        prompt = _messages(prompt, data.prompt_key, "prompt_key", where)
        chosen = _messages(chosen, data.chosen_key, "chosen_key", where)
        rejected = _messages(rejected, data.rejected_key, "rejected_key", where)
        _check_differ(chosen, rejected, where)
        return (
            _chat_ids(tokenizer, prompt, True, where),
            _chat_ids(tokenizer, prompt + chosen, False, where),
            _chat_ids(tokenizer, prompt + rejected, False, where),
        )
    for key, setting, value in (
        (data.prompt_key, "prompt_key", prompt),
        (data.chosen_key, "chosen_key", chosen),
        (data.rejected_key, "rejected_key", rejected),
    ):
        if not isinstance(value, str):
            expected = (
                "a string or a list of chat messages"
                if setting == "prompt_key"
                else "a string after a text prompt"
            )
            raise ConfigError(
                f"{where}: {key!r} must be {expected}, got {type(value).__name__} (data.{setting})"
            )
    _check_differ(chosen, rejected, where)
    eos = _eos_token(assets, where)
    chosen = chosen if chosen.endswith(eos) else chosen + eos
    rejected = rejected if rejected.endswith(eos) else rejected + eos
    return (
        list(tokenizer(text=prompt)["input_ids"]),
        list(tokenizer(text=prompt + chosen)["input_ids"]),
        list(tokenizer(text=prompt + rejected)["input_ids"]),
    )


def _check_differ(chosen: Any, rejected: Any, where: str) -> None:
    if chosen == rejected:
        raise ConfigError(
            f"{where}: chosen and rejected are the same, so the pair prefers nothing "
            "(check data.chosen_key and data.rejected_key)"
        )


def _common_prefix(ids: Sequence[int], other: Sequence[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def tokenize_pair(
    record: Mapping[str, Any], assets: TokenizerAssets, data: PreferenceDataConfig, where: str = "row"
) -> PreferencePair:
    """One row -> its prompt, chosen and rejected ids, as `DPOTrainer._prepare_dataset` tokenizes it (see
    the module docstring). A bad row is a `ConfigError` starting with `where`: a missing key (naming its
    setting and the row's keys), a value of the wrong type, chosen == rejected, a prompt that takes
    `data.max_length` tokens or a completion with no token; with truncation "error", a sequence longer
    than `data.max_length`."""
    prompt_ids, chosen_seq, rejected_seq = _sequences(record, assets, data, where)
    if chosen_seq == rejected_seq:
        raise ConfigError(
            f"{where}: chosen and rejected tokenize to the same ids, so the pair prefers nothing "
            "(check data.chosen_key and data.rejected_key)"
        )
    start = min(_common_prefix(prompt_ids, chosen_seq), _common_prefix(prompt_ids, rejected_seq))
    if start >= data.max_length:
        raise ConfigError(
            f"{where}: the prompt takes {start} tokens, leaving no room for a completion within "
            f"data.max_length {data.max_length} (shorten the prompt or raise data.max_length)"
        )
    for setting, sequence in (("chosen_key", chosen_seq), ("rejected_key", rejected_seq)):
        if len(sequence) == start:
            raise ConfigError(f"{where}: data.{setting} gives no completion token after the prompt")
        if data.truncation == "error" and len(sequence) > data.max_length:
            raise ConfigError(
                f"{where}: prompt + {setting.removesuffix('_key')} takes {len(sequence)} tokens, more than "
                f"data.max_length {data.max_length} (data.truncation 'error'; keep_start would cut it)"
            )
    return PreferencePair(
        tuple(prompt_ids[:start]), tuple(chosen_seq[start:]), tuple(rejected_seq[start:]),
        prompt_cut=start < len(prompt_ids),
    )  # fmt: skip


def preference_example(pair: PreferencePair, index: int, max_length: int) -> dict[str, Any]:
    """The example dict of one pair: {"index", "chosen_input_ids", "chosen_labels", "rejected_input_ids",
    "rejected_labels"}, each sequence prompt + completion cut to its first `max_length` tokens (keep_start),
    labels IGNORE_INDEX on the prompt and the ids on the completion (unshifted)."""
    prompt = list(pair.prompt_ids)
    masked = [IGNORE_INDEX] * len(prompt)
    example: dict[str, Any] = {"index": index}
    for name, completion in (("chosen", pair.chosen_ids), ("rejected", pair.rejected_ids)):
        example[f"{name}_input_ids"] = (prompt + list(completion))[:max_length]
        example[f"{name}_labels"] = (masked + list(completion))[:max_length]
    return example


def _is_cut(pair: PreferencePair, max_length: int) -> bool:
    return len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids)) > max_length


# ----------------------------------------------------------------------------- datasets


class PreferenceExamples(torch.utils.data.Dataset):
    """Map-style dataset of `preference_example` dicts; an example's "index" is its position here."""

    def __init__(self, pairs: Sequence[PreferencePair], max_length: int):
        self.pairs, self.max_length = list(pairs), max_length
        self.truncated = sum(_is_cut(pair, max_length) for pair in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.pairs):
            raise IndexError(f"index {index} out of range for {len(self.pairs)} preference pairs")
        return preference_example(self.pairs[index], index, self.max_length)


def _file_pairs(
    path: str, field_name: str, assets: TokenizerAssets, data: PreferenceDataConfig
) -> list[PreferencePair]:
    """Every row of one source tokenized, errors naming `field_name`, the file and the row; the rows cut
    by truncation and those whose prompt tail is left out are counted in the log."""
    keys = [("data.prompt_key", data.prompt_key), ("data.chosen_key", data.chosen_key),
            ("data.rejected_key", data.rejected_key)]  # fmt: skip
    rows = read_rows(path, field_name, [key for _, key in keys])
    check_table_formats(field_name, path, [keys], 0)  # a table's columns, checked before its rows
    source = f"{field_name} {path!r}"
    pairs = [
        tokenize_pair(record, assets, data, f"{source} {position_label(position)}")
        for position, record in rows
    ]
    truncated = sum(_is_cut(pair, data.max_length) for pair in pairs)
    if truncated:
        log.warning("%s: %d of %d rows truncated to data.max_length %d (keep_start: the end of the longer "
                    "sequences is cut)", source, truncated, len(pairs), data.max_length)  # fmt: skip
    cut = sum(pair.prompt_cut for pair in pairs)
    if cut:
        log.warning("%s: in %d of %d rows the tokenized prompt is not a prefix of prompt + completion (the chat "
                    "template renders it differently, or tokens merge across the boundary); the completion "
                    "starts where they diverge, as in TRL", source, cut, len(pairs))  # fmt: skip
    return pairs


def build_preference_datasets(
    data: PreferenceDataConfig, assets: TokenizerAssets
) -> tuple[PreferenceExamples, PreferenceExamples | None]:
    """(train, validation or None) map-style datasets of `preference_example` dicts. Validation comes from
    data.val_path, else the data.val_fraction tail of data.path's rows (held out in file order). Every row
    is read and tokenized here, so a bad file or row is a `ConfigError` before any model work."""
    pairs = _file_pairs(data.path, "data.path", assets, data)
    val_pairs: list[PreferencePair] = []
    if data.val_path:
        val_pairs = _file_pairs(data.val_path, "data.val_path", assets, data)
    elif data.val_fraction > 0:
        what = f"row of data.path {data.path!r} ({len(pairs)} rows)"
        pairs, val_pairs = held_out_tail(pairs, data.val_fraction, what)
    train_set = PreferenceExamples(pairs, data.max_length)
    val_set = PreferenceExamples(val_pairs, data.max_length) if val_pairs else None
    return train_set, val_set
