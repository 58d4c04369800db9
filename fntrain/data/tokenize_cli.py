"""The `fntrain tokenize` command: its options as one frozen record that tyro parses (the flags, their
help and defaults come from `TokenizeOptions`), and the call into `fntrain.data.tokenize`.

tyro is imported here (not in `fntrain.data.tokenize`) because the positional INPUTS argument is a tyro
annotation; only the CLI imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from fntrain.data.shard_index import ShardIndex
from fntrain.data.tokenize import DEFAULT_SHARD_TOKENS, TokenizeSettings, tokenize_files

__all__ = ["TokenizeOptions", "tokenize_command"]


@dataclass(frozen=True)
class TokenizeOptions:
    """The options of `fntrain tokenize` (each field one flag; `inputs` the positional arguments).

    Args:
        inputs: .txt / .jsonl files (optionally .gz), .parquet / .arrow files, datasets.save_to_disk folders, or directories of them, read in the order given.
        output: Directory for the shards, documents.bin and index.json.
        tokenizer: "bytes" (UTF-8 bytes) or a local Hugging Face tokenizer directory.
        eos_id: Id appended after every document (default: the tokenizer's EOS; 256 for bytes).
        shard_tokens: Tokens per shard file.
        format: Shard files as raw little-endian .bin or as .npy arrays.
        text_key: Field of each JSONL object, or column of each Parquet/Arrow row, that holds the document's text.
        split: For .txt inputs: the whole file, each line, or each blank-line separated paragraph is a document.
        batch_size: Documents per call of a batching (Hugging Face) tokenizer, and per unit of work of a text/JSONL file.
        workers: Processes that tokenize; the output is byte-identical for any number.
        overwrite: Replace the shards already in output.
    """

    inputs: Annotated[tuple[str, ...], tyro.conf.Positional]
    output: str
    tokenizer: str = "bytes"
    eos_id: int | None = None
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    format: Literal["bin", "npy"] = "bin"
    text_key: str = "text"
    split: Literal["file", "line", "paragraph"] = "file"
    batch_size: int = 1000
    workers: int = 1
    overwrite: bool = False


def tokenize_command(options: Annotated[TokenizeOptions, tyro.conf.arg(name="")]) -> ShardIndex:
    """Tokenize text, JSONL, Parquet or Arrow files into memory-mapped token shards (read with
    fntrain.data.shards).
    """
    # name="": the options' flags are the command's own (--output, not --options.output)
    settings = TokenizeSettings(
        shard_tokens=options.shard_tokens,
        format=options.format,
        batch_size=options.batch_size,
        workers=options.workers,
        overwrite=options.overwrite,
    )
    return tokenize_files(list(options.inputs), options.output, options.tokenizer, text_key=options.text_key,
                          split=options.split, eos_id=options.eos_id, settings=settings)  # fmt: skip
