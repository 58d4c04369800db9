"""The on-disk format of a token-shard directory: its `index.json`, written last and checked on read.

A shard directory holds:

    index.json          {"format": "fntrain-token-shards", "version": 1, "dtype": "<u2", "eos_id": ...,
                         "vocab_size": ..., "tokenizer": ..., "documents": D, "document_index": ...,
                         "shards": [{"path": "shard_00000.bin", "tokens": N}, ...]}
    shard_00000.bin     raw little-endian token ids (or shard_00000.npy, a 1-D .npy array)
    documents.bin       optional: int64 start offset of every document in the concatenated stream

The shards concatenate, in index order, into one token stream (a document may continue from one shard
into the next). `index.json` is written last (`write_index`, atomically), so a directory without it is
an unfinished tokenization. `read_index` checks the index and every shard file's size against it before
anything is mapped (`fntrain.data.shards` reads the tokens; `fntrain.data.tokenize` writes them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fntrain.config import ConfigError

__all__ = [
    "INDEX_NAME",
    "FORMAT",
    "VERSION",
    "ShardInfo",
    "ShardIndex",
    "read_index",
    "write_index",
    "token_dtype",
    "npy_layout",
]

INDEX_NAME = "index.json"
FORMAT = "fntrain-token-shards"
VERSION = 1
_SHARD_SUFFIXES = (".bin", ".npy")


@dataclass(frozen=True)
class ShardInfo:
    """One shard file (its path relative to the shard directory) and how many tokens it holds."""

    path: str
    tokens: int


@dataclass(frozen=True)
class ShardIndex:
    """The parsed `index.json` of a shard directory."""

    directory: Path
    dtype: str
    shards: tuple[ShardInfo, ...]
    eos_id: int | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    documents: int | None = None
    document_index: str | None = None

    @property
    def total_tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    @property
    def starts(self) -> np.ndarray:
        """Offset of each shard's first token in the concatenated stream (int64), plus the total."""
        return np.concatenate([[0], np.cumsum([s.tokens for s in self.shards], dtype=np.int64)]).astype(
            np.int64
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "total_tokens": self.total_tokens,
            "documents": self.documents,
            "document_index": self.document_index,
            "shards": [{"path": s.path, "tokens": s.tokens} for s in self.shards],
        }


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The smallest unsigned little-endian dtype that holds ids below `vocab_size` (uint32 when unknown)."""
    if vocab_size is not None and vocab_size <= 1 << 16:
        return np.dtype("<u2")
    return np.dtype("<u4")


def write_index(index: ShardIndex) -> Path:
    """Write `index.json` atomically (a temporary file renamed over it): the directory's completion mark."""
    path = index.directory / INDEX_NAME
    temporary = path.with_name(f".{INDEX_NAME}.tmp")
    temporary.write_text(json.dumps(index.to_json(), indent=1) + "\n")
    os.replace(temporary, path)
    return path


def read_index(directory: str | os.PathLike[str]) -> ShardIndex:
    """Parse and check a shard directory's `index.json`: format, dtype, and every shard file's size. An
    index that is not one is a `ConfigError` naming the file."""
    directory = Path(directory).expanduser()
    path = directory / INDEX_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no token shards at {str(directory)!r}: {INDEX_NAME} is missing (not written by `fntrain "
            "tokenize`, or the tokenization did not finish)"
        )
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:  # ValueError: JSONDecodeError and bad UTF-8
        raise ConfigError(f"{path} is not a token-shard index (not JSON: {error})") from None
    if not isinstance(raw, Mapping) or raw.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a token-shard index (format must be {FORMAT!r})")
    if raw.get("version") != VERSION:
        raise ConfigError(f"{path}: unsupported token-shard index version {raw.get('version')!r}")
    try:  # a hand-edited index: missing keys, wrong types
        dtype = np.dtype(raw["dtype"])
        shards = tuple(ShardInfo(str(s["path"]), int(s["tokens"])) for s in raw["shards"])
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            f"{path} is not a valid token-shard index ({type(error).__name__}: {error})"
        ) from None
    if dtype.kind not in "iu":
        raise ConfigError(f"{path}: dtype must be an integer type, got {raw['dtype']!r}")
    index = ShardIndex(
        directory=directory,
        dtype=dtype.str,
        shards=shards,
        eos_id=raw.get("eos_id"),
        vocab_size=raw.get("vocab_size"),
        tokenizer=raw.get("tokenizer"),
        documents=raw.get("documents"),
        document_index=raw.get("document_index"),
    )
    for shard in shards:
        _check_shard_file(directory / shard.path, shard, dtype)
    if index.document_index is not None:
        doc_path = directory / index.document_index
        expected = 8 * (index.documents or 0)
        if not doc_path.is_file() or doc_path.stat().st_size != expected:
            raise ValueError(f"{doc_path} must hold {index.documents} int64 document offsets")
    return index


def _check_shard_file(path: Path, shard: ShardInfo, dtype: np.dtype) -> None:
    if path.suffix not in _SHARD_SUFFIXES:
        raise ValueError(f"shard {str(path)!r} must be a .bin or .npy file")
    if not path.is_file():
        raise FileNotFoundError(f"shard {str(path)!r} listed in {INDEX_NAME} does not exist")
    if path.suffix == ".npy":
        _, shape, file_dtype = npy_layout(path)
        if shape != (shard.tokens,) or file_dtype != dtype:
            raise ValueError(
                f"shard {str(path)!r} holds an array of shape {shape} and dtype {file_dtype}; {INDEX_NAME} "
                f"says ({shard.tokens},) {dtype}"
            )
    elif path.stat().st_size != shard.tokens * dtype.itemsize:
        raise ValueError(
            f"shard {str(path)!r} has {path.stat().st_size} bytes; {INDEX_NAME} says {shard.tokens} tokens "
            f"of {dtype.itemsize} bytes"
        )


def npy_layout(path: Path) -> tuple[int, tuple[int, ...], np.dtype]:
    """(data offset, shape, dtype) of a C-ordered .npy file, from its header alone."""
    with open(path, "rb") as file:
        major, _ = np.lib.format.read_magic(file)
        read_header = (
            np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        )
        shape, fortran_order, dtype = read_header(file)
        if fortran_order and len(shape) > 1:
            raise ValueError(f"{path}: a token shard must be a C-ordered 1-D array")
        return file.tell(), tuple(shape), np.dtype(dtype)
