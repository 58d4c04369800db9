"""Text, JSONL, Parquet and Arrow to memory-mapped token shards (`fntrain tokenize`), read back by
`data.shards`.

Each document is tokenized without special tokens and followed by the tokenizer's EOS id, and the
documents are concatenated, in input order, into shards of `shard_tokens` tokens (the last one shorter;
a document may continue into the next shard). The output is a pure function of the inputs, their order,
the tokenizer and the settings: no timestamps, no dictionary-order effects, byte-identical on a rerun.

A tokenizer is anything that turns text into ids: `byte_tokenizer()` (UTF-8 bytes, EOS 256),
`hf_tokenizer(path_or_object)` (a local Hugging Face tokenizer; never downloads), or any callable
`text -> ids` wrapped by `as_tokenizer(fn, eos_id=...)`.

Inputs: `.jsonl` (one JSON object per line; its `text_key` field is a document), `.txt` (the whole file,
each line, or each blank-line separated paragraph is a document: `split`), either optionally gzipped;
`.parquet` and Arrow IPC `.arrow` files (each row's `text_key` column is a document; a null is none) and
`datasets.save_to_disk` folders (their Arrow files, memory-mapped: `fntrain.data.tables`); a directory
stands for its matching files, recursively, in sorted order.

The work is cut into units (blocks of `batch_size` text/JSONL documents, Parquet row groups, runs of
Arrow record batches) encoded by `workers` processes and written in input order
(`fntrain.data.tokenize_pool`): the output is byte-identical for any number of workers, and memory is
bounded by the unit size, never the corpus.

A failed tokenization leaves the disk as it found it: the inputs are checked before any tokenizing
(every JSONL line parsed, every text file decoded, every table's schema and column read), and the shards
are written into a temporary directory beside the output, moved into place only when complete (removed
on any failure).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fntrain.config import ConfigError, require_bool, require_choice, require_int, require_str
from fntrain.data.files import existing_ancestor, jsonl_rows, open_text
from fntrain.data.shards import INDEX_NAME, ShardIndex, ShardInfo, read_index, token_dtype, write_index
from fntrain.data.tables import (
    TABLE_SUFFIXES,
    is_dataset_folder,
    read_piece,
    require_text_column,
    table_files,
    table_pieces,
)
from fntrain.data.tokenize_pool import EncodedBlock, TableText, TextBlock, encoded_blocks, text_blocks

__all__ = [
    "Tokenizer",
    "byte_tokenizer",
    "hf_tokenizer",
    "as_tokenizer",
    "input_files",
    "read_documents",
    "tokenize_documents",
    "tokenize_files",
    "tokenize_command",
    "DEFAULT_SHARD_TOKENS",
]

DEFAULT_SHARD_TOKENS = 100_000_000
"""Tokens per shard by default: 200 MB of uint16, a size file systems and object stores handle well."""
DOCUMENT_INDEX = "documents.bin"
FORMATS = ("bin", "npy")
SPLITS = ("file", "line", "paragraph")
_TEXT_SUFFIXES = (".txt", ".jsonl")
_INPUT_SUFFIXES = (*_TEXT_SUFFIXES, *TABLE_SUFFIXES)
_OWN_FILE = re.compile(r"^(shard_\d+\.(bin|npy)|documents\.bin|index\.json|\.index\.json\.tmp)$")


@dataclass(frozen=True)
class Tokenizer:
    """A text -> ids function, its EOS id, and what the shard index records about it.

    encode_batch, when given, tokenizes a list of texts at once (Hugging Face fast tokenizers do that
    in parallel); it must give the same ids as `encode` on each text.
    """

    encode: Callable[[str], Sequence[int]]
    eos_id: int
    vocab_size: int | None = None
    name: str = "custom"
    encode_batch: Callable[[list[str]], Sequence[Sequence[int]]] | None = None


def byte_tokenizer(eos_id: int = 256) -> Tokenizer:
    """UTF-8 bytes as ids 0..255; EOS defaults to 256 (vocabulary 257). eos_id 0 keeps a 256-id vocabulary
    (NUL rarely occurs in text) for byte models such as recipes/tiny_gpt.py."""
    require_int("eos_id", eos_id, min=0)

    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    return Tokenizer(encode, eos_id, vocab_size=max(256, eos_id + 1), name="bytes")


def hf_tokenizer(source: Any, *, eos_id: int | None = None) -> Tokenizer:
    """A Hugging Face tokenizer: a local directory (loaded with `local_files_only`) or a tokenizer object.

    Texts are encoded without special tokens (EOS is appended by the shard writer); eos_id defaults to
    the tokenizer's `eos_token_id`."""
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoTokenizer

        path = Path(source).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer {str(source)!r} is not a local directory (nothing is downloaded)"
            )
        source = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokenizer = source
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    if eos is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no EOS token; pass eos_id"
        )

    def encode(text: str) -> Sequence[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_batch(texts: list[str]) -> Sequence[Sequence[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(
        encode,
        int(eos),
        vocab_size=len(tokenizer),
        name=str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        encode_batch=encode_batch,
    )


def as_tokenizer(tokenizer: Any, *, eos_id: int | None = None, vocab_size: int | None = None) -> Tokenizer:
    """A `Tokenizer` from: a `Tokenizer`; "bytes"; a local Hugging Face tokenizer directory; a Hugging Face
    tokenizer object; or any callable `text -> ids` (then eos_id is required). eos_id / vocab_size given
    here override the tokenizer's own."""
    if isinstance(tokenizer, Tokenizer):
        built = tokenizer
    elif isinstance(tokenizer, str) and tokenizer == "bytes":
        built = byte_tokenizer() if eos_id is None else byte_tokenizer(eos_id)
    elif isinstance(tokenizer, (str, os.PathLike)) or hasattr(tokenizer, "eos_token_id"):
        built = hf_tokenizer(tokenizer, eos_id=eos_id)
    elif callable(tokenizer):
        if eos_id is None:
            raise ValueError("a tokenizer given as a plain callable needs eos_id")
        built = Tokenizer(
            tokenizer, eos_id, vocab_size=vocab_size, name=getattr(tokenizer, "__name__", "custom")
        )
    else:
        raise TypeError(
            f"tokenizer must be a Tokenizer, 'bytes', a path, an HF tokenizer or a callable, got {tokenizer!r}"
        )
    if eos_id is not None and built.eos_id != eos_id:
        built = replace(built, eos_id=eos_id)
    if vocab_size is not None:
        built = replace(built, vocab_size=vocab_size)
    require_int("eos_id", built.eos_id, min=0)
    if built.vocab_size is not None and built.eos_id >= built.vocab_size:
        raise ValueError(f"eos_id {built.eos_id} is outside the vocabulary of {built.vocab_size} ids")
    return built


# ----------------------------------------------------------------------------- reading documents


def _stem_suffix(path: Path) -> str:
    """The suffix that says the format, under a `.gz`: 'a.jsonl.gz' -> '.jsonl'."""
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def _is_table(path: Path) -> bool:
    return path.suffix in TABLE_SUFFIXES


def input_files(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files to read, in order: each file as given, a save_to_disk folder's Arrow files in its
    state.json order, each other directory's .txt/.jsonl(.gz)/.parquet/.arrow files sorted."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if is_dataset_folder(path):
            files.extend(table_files(path, f"input {str(item)!r}"))
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _stem_suffix(p) in _INPUT_SUFFIXES
                           and not (p.suffix == ".gz" and _is_table(Path(p.stem))))  # fmt: skip
            if not found:
                raise FileNotFoundError(
                    f"input directory {str(item)!r} holds no .txt, .jsonl, .parquet or .arrow files"
                )
            files.extend(found)
        elif path.is_file():
            if _stem_suffix(path) not in _INPUT_SUFFIXES or (path.suffix == ".gz" and _is_table(Path(path.stem))):
                raise ValueError(
                    f"input {str(item)!r} must be a .txt or .jsonl file (optionally .gz), a .parquet or "
                    ".arrow file, or a datasets.save_to_disk folder"
                )
            files.append(path)
        else:
            raise FileNotFoundError(f"input {str(item)!r} does not exist")
    return files


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    where = f"input {str(path)!r}"
    for number, record in jsonl_rows(path, where):
        text = record.get(text_key)
        if not isinstance(text, str):
            raise ConfigError(f"{where} line {number}: expected an object with a string {text_key!r} field")
        yield text


def _text_documents(path: Path, split: str) -> Iterator[str]:
    try:
        with open_text(path) as file:
            if split == "file":
                yield file.read()
            elif split == "line":
                for line in file:
                    line = line.rstrip("\n")
                    if line.strip():
                        yield line
            else:
                yield from (p for p in re.split(r"\n\s*\n", file.read()) if p.strip())
    except UnicodeDecodeError:
        raise ConfigError(f"input {str(path)!r} is not UTF-8 text (a binary file?)") from None
    except (EOFError, OSError) as error:  # a .gz that is not gzip, a file that cannot be read
        raise ConfigError(f"input {str(path)!r} cannot be read ({error})") from None


def read_documents(
    inputs: Sequence[str | os.PathLike[str]], *, text_key: str = "text", split: str = "file"
) -> Iterator[str]:
    """The documents of `inputs`, in order (see the module docstring). A JSONL line that is not an object
    with a string `text_key`, or a file that is not UTF-8 text, is a `ConfigError` naming the file and
    line."""
    require_choice("split", split, SPLITS)
    for path in input_files(inputs):
        yield from _file_documents(path, text_key, split)


def _file_documents(path: Path, text_key: str, split: str) -> Iterator[str]:
    if _is_table(path):
        for piece in table_pieces(path, f"input {str(path)!r}"):
            for batch in read_piece(piece, [text_key]):
                yield from (text for text in batch.column(0).to_pylist() if text is not None)
    elif _stem_suffix(path) == ".jsonl":
        yield from _jsonl_documents(path, text_key)
    else:
        yield from _text_documents(path, split)


def _check_inputs(files: Sequence[Path], text_key: str, split: str) -> None:
    """Phase 1 of a tokenization: every table's schema has a string `text_key` column and its metadata
    reads (for all of them, before any text is read); then every text/JSONL file is read through."""
    for path in files:
        if _is_table(path):
            require_text_column(path, text_key, f"input {str(path)!r}")
            table_pieces(path, f"input {str(path)!r}")
    for path in files:
        if not _is_table(path):
            collections.deque(_file_documents(path, text_key, split), maxlen=0)


def _work_units(files: Sequence[Path], text_key: str, split: str, batch_size: int) -> Iterator[TextBlock | TableText]:
    """The files' deterministic units, in input order: each table piece, and blocks of `batch_size`
    documents of each text/JSONL file."""
    for path in files:
        where = f"input {str(path)!r}"
        if _is_table(path):
            yield from (TableText(piece, text_key) for piece in table_pieces(path, where))
        else:
            yield from text_blocks(_file_documents(path, text_key, split), batch_size, where)


# ----------------------------------------------------------------------------- writing shards


def _check_output(output: Path, overwrite: bool) -> None:
    """Refuse an output that is a file, that cannot be created, or (unless `overwrite`) that already
    holds a tokenization; nothing is written."""
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"output {str(output)!r} exists and is not a directory")
    existing_ancestor(output)
    own = [p for p in output.iterdir() if _OWN_FILE.match(p.name)] if output.is_dir() else []
    if own and not overwrite:
        done = (output / INDEX_NAME).exists()
        raise FileExistsError(
            f"output {str(output)!r} already holds {'token shards' if done else 'an unfinished tokenization'}; "
            "pass overwrite=True (--overwrite) to replace it"
        )


@contextlib.contextmanager
def _staged_output(output: Path) -> Iterator[Path]:
    """A fresh directory beside `output` (in its nearest existing ancestor) to write into. When the
    block succeeds it becomes `output`: renamed there, or, when `output` exists (it may hold other
    files), the old tokenization's files are removed and the new ones moved in, index.json last so an
    interruption reads as unfinished. When the block fails it is removed and `output` is untouched."""
    staging = existing_ancestor(output) / f".{output.name}.tmp-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        yield staging
        if not output.exists():
            output.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, output)
            return
        old = [p for p in output.iterdir() if _OWN_FILE.match(p.name)]
        for path in sorted(old, key=lambda p: p.name != INDEX_NAME):  # the completion mark goes first
            path.unlink()
        for path in sorted(staging.iterdir(), key=lambda p: p.name == INDEX_NAME):  # and comes back last
            os.replace(path, output / path.name)
        staging.rmdir()
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)



@dataclass
class _ShardWriter:
    """The shard being filled (`buffer[:filled]`) and the shards written so far, under `output`."""

    output: Path
    format: str
    buffer: np.ndarray
    filled: int = 0
    written: list[ShardInfo] = field(default_factory=list)


def _flush_shard(shards: _ShardWriter) -> None:
    """Write the filled part of the buffer as the next shard file and start an empty one."""
    name = f"shard_{len(shards.written):05d}.{shards.format}"
    if shards.format == "npy":
        np.save(shards.output / name, shards.buffer[: shards.filled], allow_pickle=False)
    else:
        shards.buffer[: shards.filled].tofile(shards.output / name)
    shards.written.append(ShardInfo(name, shards.filled))
    shards.filled = 0


def _append_ids(shards: _ShardWriter, ids: np.ndarray) -> None:
    """Copy `ids` into the shards, flushing each one as it fills up (a document may span shards)."""
    buffer = shards.buffer
    shard_tokens = len(buffer)
    offset = 0
    while offset < len(ids):
        filled = shards.filled
        take = min(len(ids) - offset, shard_tokens - filled)
        buffer[filled : filled + take] = ids[offset : offset + take]
        shards.filled = filled = filled + take
        offset += take
        if filled == shard_tokens:
            _flush_shard(shards)



def _write_blocks(blocks: Iterable[EncodedBlock], shards: _ShardWriter, index_path: Path) -> int:
    """Append each block's tokens to `shards`, and its documents' start offsets (int64 little-endian)
    to the document index at `index_path`; return the number of documents written."""
    position = documents_written = 0
    with open(index_path, "wb") as document_index:
        for block in blocks:
            if not block.lengths.size:
                continue
            starts = position + np.cumsum(block.lengths) - block.lengths
            starts.astype("<i8").tofile(document_index)
            _append_ids(shards, block.tokens)
            position += len(block.tokens)
            documents_written += len(block.lengths)
    return documents_written


def tokenize_documents(
    documents: Iterable[str],
    output: str | os.PathLike[str],
    tokenizer: Any = "bytes",
    *,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    format: str = "bin",
    batch_size: int = 1000,
    workers: int = 1,
    overwrite: bool = False,
) -> ShardIndex:
    """Tokenize `documents` (texts, in order) into shards under `output`; return the checked index.

    Empty documents (no ids) are skipped. Ids must fit the shard dtype (uint16 for vocabularies up to
    65536 ids, else uint32) and, when the vocabulary size is known, lie below it. Blocks of `batch_size`
    documents are encoded by `workers` processes (byte-identical output for any number). `index.json`
    is written last: a directory holding it is complete.
    """
    tok = as_tokenizer(tokenizer, eos_id=eos_id, vocab_size=vocab_size)
    require_int("batch_size", batch_size, min=1)
    return _tokenize_units(lambda: text_blocks(iter(documents), batch_size), output, tok, shard_tokens=shard_tokens,
                           format=format, batch_size=batch_size, workers=workers, overwrite=overwrite)  # fmt: skip


def _tokenize_units(units: Callable[[], Iterator[TextBlock | TableText]], output: str | os.PathLike[str],
                    tok: Tokenizer, *, shard_tokens: int, format: str, batch_size: int, workers: int,
                    overwrite: bool) -> ShardIndex:  # fmt: skip
    """The settings checked, then the units' shards written into a staged directory that becomes `output`."""
    require_int("shard_tokens", shard_tokens, min=1)
    require_choice("format", format, FORMATS)
    require_int("batch_size", batch_size, min=1)
    require_int("workers", workers, min=1)
    require_bool("overwrite", overwrite)
    out = Path(output).expanduser()
    _check_output(out, overwrite)
    with _staged_output(out) as staging:
        _write_shards(units(), tok, staging, shard_tokens, format, batch_size, workers)
    return read_index(out)


def _write_shards(units: Iterator[TextBlock | TableText], tok: Tokenizer, out: Path, shard_tokens: int, format: str,
                  batch_size: int, workers: int) -> None:  # fmt: skip
    """The shards, the document index and (last) index.json of the units' documents in the directory `out`."""
    dtype = token_dtype(tok.vocab_size)
    limit = (tok.vocab_size or np.iinfo(dtype).max + 1) - 1
    shards = _ShardWriter(out, format, np.empty(shard_tokens, dtype=dtype))
    blocks = encoded_blocks(units, tok, dtype=dtype, limit=limit, batch_size=batch_size, workers=workers)
    documents_written = _write_blocks(blocks, shards, out / DOCUMENT_INDEX)
    if shards.filled or not shards.written:
        _flush_shard(shards)
    index = ShardIndex(
        directory=out,
        dtype=dtype.str,
        shards=tuple(shards.written),
        eos_id=tok.eos_id,
        vocab_size=tok.vocab_size,
        tokenizer=tok.name,
        documents=documents_written,
        document_index=DOCUMENT_INDEX,
    )
    write_index(index)


def tokenize_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    tokenizer: Any = "bytes",
    *,
    text_key: str = "text",
    split: str = "file",
    eos_id: int | None = None,
    vocab_size: int | None = None,
    batch_size: int = 1000,
    **options: Any,
) -> ShardIndex:
    """`tokenize_documents` over the documents of text/JSONL/Parquet/Arrow inputs (see `read_documents`).
    The inputs are checked before anything is tokenized or written (`_check_inputs`: a bad line or a
    missing column fails in seconds, not after hours of tokenizing); tables are then read piece by
    piece by the workers themselves."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("tokenize needs at least one input file or directory")
    require_str("text_key", text_key, non_empty=True)
    require_choice("split", split, SPLITS)
    require_int("batch_size", batch_size, min=1)
    _check_output(Path(output).expanduser(), bool(options.get("overwrite", False)))
    files = input_files(inputs)
    _check_inputs(files, text_key, split)
    tok = as_tokenizer(tokenizer, eos_id=eos_id, vocab_size=vocab_size)
    options.setdefault("shard_tokens", DEFAULT_SHARD_TOKENS)
    options.setdefault("format", "bin")
    options.setdefault("workers", 1)
    options.setdefault("overwrite", False)
    return _tokenize_units(lambda: _work_units(files, text_key, split, batch_size), output, tok,
                           batch_size=batch_size, **options)  # fmt: skip


def tokenize_command(
    inputs: tuple[str, ...],
    /,
    output: str,
    tokenizer: str = "bytes",
    eos_id: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    format: Literal["bin", "npy"] = "bin",
    text_key: str = "text",
    split: Literal["file", "line", "paragraph"] = "file",
    batch_size: int = 1000,
    workers: int = 1,
    overwrite: bool = False,
) -> ShardIndex:
    """Tokenize text, JSONL, Parquet or Arrow files into memory-mapped token shards (read with
    fntrain.data.shards).

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
    return tokenize_files(
        list(inputs),
        output,
        tokenizer,
        eos_id=eos_id,
        shard_tokens=shard_tokens,
        format=format,
        text_key=text_key,
        split=split,
        batch_size=batch_size,
        workers=workers,
        overwrite=overwrite,
    )
