"""Writing token shards: the output directory checked, staged beside it and moved into place only when
complete, and the encoded blocks cut into shard files with their document index.

The format written is `fntrain.data.shard_index`'s. A failed write leaves the disk as it found it: the
shards go into a temporary directory beside the output, removed on any failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fntrain.data.files import existing_ancestor
from fntrain.data.shard_index import INDEX_NAME, ShardIndex, ShardInfo, token_dtype, write_index
from fntrain.data.tokenize_pool import EncodedBlock, TableText, TextBlock, encoded_blocks
from fntrain.data.tokenizers import Tokenizer

__all__ = ["DOCUMENT_INDEX", "FORMATS", "check_output", "staged_output", "write_shards"]

DOCUMENT_INDEX = "documents.bin"
FORMATS = ("bin", "npy")
_OWN_FILE = re.compile(r"^(shard_\d+\.(bin|npy)|documents\.bin|index\.json|\.index\.json\.tmp)$")


def check_output(output: Path, overwrite: bool) -> None:
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
def staged_output(output: Path) -> Iterator[Path]:
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


def write_shards(units: Iterator[TextBlock | TableText], tok: Tokenizer, out: Path, shard_tokens: int, format: str,
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
