"""Text, JSONL, Parquet and Arrow to memory-mapped token shards (`fntrain tokenize`), read back by
`data.shards`.

Each document is tokenized without special tokens and followed by the tokenizer's EOS id, and the
documents are concatenated, in input order, into shards of `shard_tokens` tokens (the last one shorter;
a document may continue into the next shard). The output is a pure function of the inputs, their order,
the tokenizer and the settings: no timestamps, no dictionary-order effects, byte-identical on a rerun.

A tokenizer is anything that turns text into ids (`fntrain.data.tokenizers`): "bytes" (UTF-8 bytes, EOS
256), a local Hugging Face tokenizer directory or object (never downloads), or any callable `text -> ids`
with `eos_id`.

Inputs: `.jsonl` (one JSON object per line; its `text_key` field is a document), `.txt` (the whole file,
each line, or each blank-line separated paragraph is a document: `split`), either optionally gzipped;
`.parquet` and Arrow IPC `.arrow` files (each row's `text_key` column is a document; a null is none) and
`datasets.save_to_disk` folders (their Arrow files, memory-mapped: `fntrain.data.tables`); a directory
stands for its matching files, recursively, in sorted order (`fntrain.data.tokenize_inputs`).

The work is cut into units (blocks of `batch_size` text/JSONL documents, Parquet row groups, runs of
Arrow record batches) encoded by `workers` processes and written in input order
(`fntrain.data.tokenize_pool`): the output is byte-identical for any number of workers, and memory is
bounded by the unit size, never the corpus.

A failed tokenization leaves the disk as it found it: the inputs are checked before any tokenizing
(every JSONL line parsed, every text file decoded, every table's schema and column read), and the shards
are written into a temporary directory beside the output, moved into place only when complete (removed
on any failure: `fntrain.data.shard_writer`).

How the documents are encoded and written (shard size, file format, batch size, workers, overwrite) is
one frozen record, `TokenizeSettings`; `fntrain tokenize`'s options are `fntrain.data.tokenize_cli`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.config import require_bool, require_choice, require_int, require_str
from fntrain.data.shard_index import ShardIndex, read_index
from fntrain.data.shard_writer import FORMATS, check_output, staged_output, write_shards
from fntrain.data.tokenize_inputs import SPLITS, check_inputs, input_files, work_units
from fntrain.data.tokenize_pool import TableText, TextBlock, text_blocks
from fntrain.data.tokenizers import Tokenizer, as_tokenizer

__all__ = ["DEFAULT_SHARD_TOKENS", "TokenizeSettings", "tokenize_documents", "tokenize_files"]

DEFAULT_SHARD_TOKENS = 100_000_000
"""Tokens per shard by default: 200 MB of uint16, a size file systems and object stores handle well."""


@dataclass(frozen=True)
class TokenizeSettings:
    """How documents are encoded and written; checked when a tokenization starts (errors name the field).

    shard_tokens: tokens per shard file. format: "bin" (raw little-endian) or "npy". batch_size:
    documents per call of a batching tokenizer and per unit of work. workers: encoding processes (the
    output is byte-identical for any number). overwrite: replace a tokenization already in the output.
    """

    shard_tokens: int = DEFAULT_SHARD_TOKENS
    format: str = "bin"
    batch_size: int = 1000
    workers: int = 1
    overwrite: bool = False


def tokenize_documents(
    documents: Iterable[str],
    output: str | os.PathLike[str],
    tokenizer: Any = "bytes",
    *,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    settings: TokenizeSettings = TokenizeSettings(),
) -> ShardIndex:
    """Tokenize `documents` (texts, in order) into shards under `output`; return the checked index.

    Empty documents (no ids) are skipped. Ids must fit the shard dtype (uint16 for vocabularies up to
    65536 ids, else uint32) and, when the vocabulary size is known, lie below it. Blocks of
    `settings.batch_size` documents are encoded by `settings.workers` processes (byte-identical output
    for any number). `index.json` is written last: a directory holding it is complete.
    """
    tok = as_tokenizer(tokenizer, eos_id=eos_id, vocab_size=vocab_size)
    require_int("batch_size", settings.batch_size, min=1)
    return _tokenize_units(lambda: text_blocks(iter(documents), settings.batch_size), output, tok, settings)


def tokenize_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    tokenizer: Any = "bytes",
    *,
    text_key: str = "text",
    split: str = "file",
    eos_id: int | None = None,
    vocab_size: int | None = None,
    settings: TokenizeSettings = TokenizeSettings(),
) -> ShardIndex:
    """`tokenize_documents` over the documents of text/JSONL/Parquet/Arrow inputs (see
    `fntrain.data.tokenize_inputs.read_documents`). The inputs are checked before anything is tokenized
    or written (`check_inputs`: a bad line or a missing column fails in seconds, not after hours of
    tokenizing); tables are then read piece by piece by the workers themselves."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("tokenize needs at least one input file or directory")
    require_str("text_key", text_key, non_empty=True)
    require_choice("split", split, SPLITS)
    require_int("batch_size", settings.batch_size, min=1)
    check_output(Path(output).expanduser(), bool(settings.overwrite))
    files = input_files(inputs)
    check_inputs(files, text_key, split)
    tok = as_tokenizer(tokenizer, eos_id=eos_id, vocab_size=vocab_size)
    return _tokenize_units(lambda: work_units(files, text_key, split, settings.batch_size), output, tok, settings)


def _tokenize_units(units: Callable[[], Iterator[TextBlock | TableText]], output: str | os.PathLike[str],
                    tok: Tokenizer, settings: TokenizeSettings) -> ShardIndex:  # fmt: skip
    """The settings checked, then the units' shards written into a staged directory that becomes `output`."""
    require_int("shard_tokens", settings.shard_tokens, min=1)
    require_choice("format", settings.format, FORMATS)
    require_int("batch_size", settings.batch_size, min=1)
    require_int("workers", settings.workers, min=1)
    require_bool("overwrite", settings.overwrite)
    out = Path(output).expanduser()
    check_output(out, settings.overwrite)
    with staged_output(out) as staging:
        write_shards(units(), tok, staging, settings.shard_tokens, settings.format, settings.batch_size,
                     settings.workers)  # fmt: skip
    return read_index(out)
