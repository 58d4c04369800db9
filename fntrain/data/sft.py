"""Supervised fine-tuning data: JSONL or table rows -> token ids and labels -> padded or packed samples.

    data = SFTDataConfig(path="chat.jsonl", max_length=1024, packing=True)
    data.validate()                                   # before any model work: fields and files
    train_set, val_set = build_sft_datasets(data, assets)
    collate = make_sft_collate(assets.pad_id, max_length=data.max_length, pad_to=data.pad_to,
                               pad_multiple=data.pad_multiple)   # fntrain.data.sft_collate

Formats (one JSON object per line): {"text": ...} trains on every token; {"prompt": ..., "completion": ...}
and {"messages": [{"role": ..., "content": ...}, ...]} (rendered with the tokenizer's chat template)
train on the completion / the assistant turns only: every other token's label is IGNORE_INDEX.
A Parquet/Arrow file or a `datasets.save_to_disk` folder serves as well: each row is an example whose
columns are its keys (a null cell is a missing key), so the key settings map columns
(`fntrain.data.files.read_rows`); errors name its rows 0-based, as `datasets` indexes them.

`assets` is any object with `tokenizer` (a Hugging Face tokenizer, or anything with its call,
`apply_chat_template` and `is_fast`), `pad_id`, `eos_id` and `chat_template` (`TokenizerAssets`;
`fntrain.models.hf.ModelAssets` is one).

Padding: one example per sample, truncated to `max_length`; the collate right-pads (labels IGNORE_INDEX)
each micro-batch to its longest example rounded up to `pad_multiple` (at most `max_length`; `pad_to
max_length`: every micro-batch to `max_length`, static shapes) and adds a 2-D `attention_mask` [batch,
seq] (1: real token) only when something was padded.

Packing keeps examples apart, so each one trains exactly as if it were alone (fntrain.data.packing):
whole examples are bin-packed into `max_length`-token windows (best fit decreasing, deterministic); an
example longer than `max_length` is split into `max_length`-token pieces, each its own document. The
rest of a window (its tail) is padding: pad tokens, IGNORE_INDEX labels and the document id
PADDING_DOCUMENT, so no token is dropped. A packed sample carries `document_ids` and `position_ids`
(restarting at 0 for each example), and the label at each example's first token is IGNORE_INDEX, so no
target crosses from one example into the next. The collate adds `attention_mask`: a 4-D boolean
block-diagonal causal mask [batch, 1, seq, seq], True where a query may attend a key. transformers
(checked with 5.x) hands a 4-D mask to the attention kernel unchanged and rotates by `position_ids`:
with attn_implementation="sdpa" (and TinyGPT) the boolean mask is what `scaled_dot_product_attention`
reads; "eager" would add it to the scores as 0/1, so packing needs sdpa
(`fntrain.models.hf_config.check_packed_attention`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch

from fntrain.config import (
    ConfigError,
    require_bool,
    require_choice,
    require_int,
    require_str,
)
from fntrain.data.chat import chat_spans, tokenize_spans
from fntrain.data.files import held_out_tail, position_label, read_jsonl_rows, read_rows, require_split
from fntrain.data.formats import Format, check_table_formats, fitting_format, no_format_error
from fntrain.data.packing import PackedDocuments
from fntrain.data.sft_collate import PAD_TO
from fntrain.data.tokens import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "FORMATS",
    "SFTDataConfig",
    "TokenizerAssets",
    "Example",
    "read_jsonl",
    "example_format",
    "transform_example",
    "build_examples",
    "PaddedExamples",
    "pack_examples",
    "build_dataset",
    "build_sft_datasets",
]

log = logging.getLogger("fntrain.data.sft")

FORMATS = ("auto", "text", "prompt_completion", "chat")


@dataclass(frozen=True)
class SFTDataConfig:
    """The training data (JSONL or a table) and how it becomes token windows."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path", "val_path")

    path: str = ""
    """JSONL file (.jsonl or .jsonl.gz), one example per line: {"text"}, {"prompt", "completion"} or {"messages"}; or a .parquet/.arrow file, a folder of them or a datasets.save_to_disk folder, one example per row with those columns. Required."""
    format: Literal["auto", "text", "prompt_completion", "chat"] = "auto"
    """Example format (auto: decided per line by the keys present)."""
    text_key: str = "text"
    """Key (column) of the text of a text example."""
    prompt_key: str = "prompt"
    """Key (column) of the prompt of a prompt/completion example."""
    completion_key: str = "completion"
    """Key (column) of the completion of a prompt/completion example."""
    messages_key: str = "messages"
    """Key (column) of the message list of a chat example."""
    max_length: int = 1024
    """Tokens per sample: longer examples are truncated (padding) or split across windows (packing)."""
    packing: bool = False
    """Pack whole examples into max_length windows (each example attends only to itself) instead of padding one example per sample."""
    pad_to: Literal["longest", "max_length"] = "longest"
    """Padding: each micro-batch to its longest example rounded up to pad_multiple, or every one to max_length (static shapes, e.g. for compile)."""
    pad_multiple: int = 8
    """pad_to longest: round the padded length up to a multiple of this (capped at max_length; 1: the longest example exactly)."""
    train_on_prompt: bool = False
    """Also train on prompt tokens (system/user turns, prompts); by default their labels are ignored."""
    add_eos: bool = True
    """Append the EOS token to text examples and completions (chat templates end turns themselves)."""
    val_path: str | None = None
    """Validation examples for evaluation, in any format data.path takes (None: the val_fraction tail of data.path)."""
    val_fraction: float = 0.0
    """Tail fraction of data.path's examples held out for evaluation when val_path is None."""

    def validate(self, prefix: str = "data") -> None:
        """Value rules, each error naming `prefix.field`; the data files (or table folders) must exist (a
        `ConfigError` otherwise), so a bad path fails before any model work. Their rows are read and
        checked by `build_sft_datasets`."""
        require_str(f"{prefix}.path", self.path)
        if not self.path:
            raise ValueError(f"{prefix}.path is required: a JSONL file of training examples")
        require_choice(f"{prefix}.format", self.format, FORMATS)
        for name in ("text_key", "prompt_key", "completion_key", "messages_key"):
            require_str(f"{prefix}.{name}", getattr(self, name), non_empty=True)
        require_int(f"{prefix}.max_length", self.max_length, min=2)
        for name in ("packing", "train_on_prompt", "add_eos"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_choice(f"{prefix}.pad_to", self.pad_to, PAD_TO)
        require_int(f"{prefix}.pad_multiple", self.pad_multiple, min=1)
        require_split(prefix, self.path, self.val_path, self.val_fraction)


class TokenizerAssets(Protocol):
    """What the data transform reads from the model's assets."""

    @property
    def tokenizer(self) -> Any: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def chat_template(self) -> str | None: ...


@dataclass(frozen=True)
class Example:
    """One tokenized example: token ids and their labels (IGNORE_INDEX on tokens not trained on)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


# ----------------------------------------------------------------------------- reading and transforming


def read_jsonl(path: str, field_name: str = "data.path") -> list[dict[str, Any]]:
    """The objects of a JSONL file (`.jsonl.gz` too; blank lines skipped), read in full. A missing,
    empty or non-JSON file, or a bad line, is a `ConfigError` naming `field_name`, the file and the
    line (`fntrain.data.files.read_jsonl_rows`, which also gives the line numbers)."""
    return [record for _, record in read_jsonl_rows(path, field_name)]


def example_format(record: Mapping[str, Any], data: SFTDataConfig, where: str = "example") -> str:
    """The format of one record: `data.format`, or decided by its keys when "auto" (a `ConfigError`
    starting with `where` when no format's keys are there)."""
    if data.format != "auto":
        return data.format
    formats = _formats(data)
    found = fitting_format(record, formats)
    if found is None:
        raise no_format_error(where, record, formats)
    return _FORMAT_NAMES[found]


# The formats in the order "auto" tries them (a row with messages is a chat whatever else it has).
_FORMAT_NAMES = ("chat", "prompt_completion", "text")


def _formats(data: SFTDataConfig) -> list[Format]:
    """Each format of `_FORMAT_NAMES` as its key settings (dotted fields, which print as flags) and keys."""
    return [
        [("data.messages_key", data.messages_key)],
        [("data.prompt_key", data.prompt_key), ("data.completion_key", data.completion_key)],
        [("data.text_key", data.text_key)],
    ]


def _field(record: Mapping[str, Any], key: str, kind: type, where: str, data: SFTDataConfig) -> Any:
    if key not in record:  # only under a fixed format: under auto, the format was chosen by its keys
        setting = next(f for f in ("text_key", "prompt_key", "completion_key", "messages_key") if getattr(data, f) == key)
        raise ConfigError(
            f"{where}: missing key {key!r} (data.format {data.format!r} needs it; the example has keys "
            f"{sorted(record)}): check data.{setting}"
        )
    value = record[key]
    if not isinstance(value, kind):
        raise ConfigError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _ended(ids: list[int], labels: list[int], eos: list[int]) -> Example:
    """The example ending with one trained EOS (`eos`: [id], or [] for none): appended, or, when the
    tokenizer already ends the text with it, that one trained (it is labelled with the prompt's special
    tokens otherwise), so the model learns to stop after the text, not to repeat the EOS."""
    if eos and ids and ids[-1] == eos[0]:
        return Example(tuple(ids), tuple(labels[:-1] + eos))
    return Example(tuple(ids + eos), tuple(labels + eos))


def transform_example(
    record: Mapping[str, Any], assets: TokenizerAssets, data: SFTDataConfig, where: str = "example"
) -> Example:
    """One JSONL record -> token ids and labels (the data transform); a record that does not fit its
    format is a `ConfigError` starting with `where`."""
    tokenizer = assets.tokenizer
    kind = example_format(record, data, where)
    eos = [assets.eos_id] if data.add_eos and assets.eos_id is not None else []
    if kind == "text":
        text = _field(record, data.text_key, str, where, data)
        ids, labels = tokenize_spans(tokenizer, text, [], add_special_tokens=True, train_all=True)
        return _ended(ids, labels, eos)
    if kind == "prompt_completion":
        prompt = _field(record, data.prompt_key, str, where, data)
        completion = _field(record, data.completion_key, str, where, data)
        text = prompt + completion
        ids, labels = tokenize_spans(
            tokenizer,
            text,
            [(len(prompt), len(text))],
            add_special_tokens=True,
            train_all=data.train_on_prompt,
        )
        return _ended(ids, labels, eos)
    messages = _field(record, data.messages_key, list, where, data)
    text, spans = chat_spans(tokenizer, assets.chat_template, messages, where)
    ids, labels = tokenize_spans(
        tokenizer, text, spans, add_special_tokens=False, train_all=data.train_on_prompt
    )
    return Example(tuple(ids), tuple(labels))


def build_examples(
    records: Sequence[Mapping[str, Any]],
    assets: TokenizerAssets,
    data: SFTDataConfig,
    source: str = "data.path",
    lines: Sequence[int | str] | None = None,
) -> list[Example]:
    """Every record transformed, each error naming `source` and the record's position (`lines`: the
    records' line numbers in their file, or table row labels such as "row 3") or its number; examples with no trained token (within
    max_length when padding; the first label is never a target) are dropped with a warning. No example
    left is a `ConfigError`."""
    limit = None if data.packing else data.max_length
    examples, empty = [], 0
    for number, record in enumerate(records, start=1):
        where = f"{source} {position_label(lines[number - 1])}" if lines is not None else f"{source} example {number}"
        example = transform_example(record, assets, data, where=where)
        if all(label == IGNORE_INDEX for label in example.labels[1:limit]):
            empty += 1
            continue
        examples.append(example)
    if empty:
        log.warning("%s: dropped %d of %d examples with no token to train on", source, empty, len(records))
    if not examples:
        raise ConfigError(f"{source} yields no example with a token to train on")
    return examples


# ----------------------------------------------------------------------------- datasets


class PaddedExamples(torch.utils.data.Dataset):
    """One example per sample, truncated to `max_length` (padding happens in the collate fn)."""

    def __init__(self, examples: Sequence[Example], max_length: int):
        self.examples, self.max_length = list(examples), max_length
        self.truncated = sum(len(e.input_ids) > max_length for e in self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        example = self.examples[index]
        return {
            "input_ids": list(example.input_ids[: self.max_length]),
            "labels": list(example.labels[: self.max_length]),
        }


def pack_examples(examples: Sequence[Example], max_length: int, *, pad_id: int = 0) -> PackedDocuments:
    """Examples bin-packed into windows of exactly `max_length` tokens, each example its own document
    (`fntrain.data.packing.PackedDocuments`: samples with input_ids, labels with each example's first
    label IGNORE_INDEX, position_ids from 0 per example, document_ids; the tail of a window is padding
    with `pad_id`, IGNORE_INDEX labels and document id PADDING_DOCUMENT). Longer examples are split into
    `max_length`-token pieces. The packing is a pure function of the example lengths."""
    documents = [{"input_ids": list(e.input_ids), "labels": list(e.labels)} for e in examples]
    return PackedDocuments(documents, max_length, pad_id=pad_id, lengths=[len(e.input_ids) for e in examples])


def build_dataset(
    examples: Sequence[Example], data: SFTDataConfig, *, pad_id: int = 0
) -> torch.utils.data.Dataset:
    """Padded (one example per sample) or packed windows, per `data.packing`."""
    if data.packing:
        packed = pack_examples(examples, data.max_length, pad_id=pad_id)
        log.info("packed %d examples into %d windows of %d tokens (%.0f%% filled)", len(examples),
                 len(packed), data.max_length, 100 * packed.fill)  # fmt: skip
        return packed
    dataset = PaddedExamples(examples, data.max_length)
    if dataset.truncated:
        log.warning("%d examples are longer than data.max_length (%d) and are truncated", dataset.truncated,
                    data.max_length)  # fmt: skip
    return dataset


def build_sft_datasets(
    data: SFTDataConfig, assets: TokenizerAssets
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    """(train, validation or None): JSONL or table rows -> examples -> padded or packed datasets.
    Validation comes from data.val_path, else the data.val_fraction tail of the training examples. Every
    row is read and tokenized here, so a bad file or row is a `ConfigError` naming the field, the file
    and the line (or row) before any training (never a failure at step N)."""
    examples = _file_examples(data.path, "data.path", assets, data)
    val_examples: list[Example] = []
    if data.val_path:
        val_examples = _file_examples(data.val_path, "data.val_path", assets, data)
    elif data.val_fraction > 0:
        examples, val_examples = held_out_tail(examples, data.val_fraction, "example")
    train_set = build_dataset(examples, data, pad_id=assets.pad_id)
    val_set = build_dataset(val_examples, data, pad_id=assets.pad_id) if val_examples else None
    return train_set, val_set


def _file_examples(path: str, field_name: str, assets: TokenizerAssets, data: SFTDataConfig) -> list[Example]:
    columns = (data.text_key, data.prompt_key, data.completion_key, data.messages_key)
    rows = read_rows(path, field_name, columns)
    fixed = None if data.format == "auto" else _FORMAT_NAMES.index(data.format)
    check_table_formats(field_name, path, _formats(data), fixed)  # a table's rows hold only `columns`
    lines = [number for number, _ in rows]
    return build_examples([record for _, record in rows], assets, data, f"{field_name} {path!r}", lines)
