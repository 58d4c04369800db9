"""The work of `fntrain tokenize` cut into deterministic units, encoded in order in one process or in a
pool of worker processes.

    for block in encoded_blocks(units, tokenizer, dtype=np.dtype("<u2"), workers=4, batch_size=1000):
        ...  # block.tokens: the documents' ids, each followed by EOS; block.lengths: each one's length

A unit is a `TextBlock` (documents the main process read: text and JSONL files, any iterable of texts)
or a `TableText` (a piece of a Parquet/Arrow file, which the worker reads itself, so no text crosses
between processes). A unit's block is a pure function of the unit and the tokenizer, and the blocks come
back in unit order, so what is written is byte-identical for any number of workers. At most
`2 * workers` units are in flight: memory stays bounded by the unit size, not the corpus.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from fntrain.data.tables import TablePiece, read_piece

__all__ = ["TextBlock", "TableText", "EncodedBlock", "encode_unit", "encoded_blocks", "text_blocks"]


@dataclass(frozen=True)
class TextBlock:
    """Documents read by the main process; `first` numbers the first one within `where` (for errors)."""

    texts: tuple[str, ...]
    first: int = 0
    where: str = ""


@dataclass(frozen=True)
class TableText:
    """The `column` of a table piece (null cells are no document)."""

    piece: TablePiece
    column: str


@dataclass(frozen=True)
class EncodedBlock:
    """A unit's non-empty documents: their ids, each followed by EOS, end to end (`tokens`, in the shard
    dtype), and each one's length with its EOS (`lengths`, int64)."""

    tokens: np.ndarray
    lengths: np.ndarray


@dataclass(frozen=True)
class _Settings:
    tokenizer: Any  # a fntrain.data.tokenizers.Tokenizer
    dtype: np.dtype
    limit: int
    batch_size: int


def _label(where: str, word: str, number: int) -> str:
    return f"{where} {word} {number}" if where else f"{word} {number}"


def _encode_texts(texts: list[str | None], settings: _Settings, name: Any) -> tuple[list[np.ndarray], list[int]]:
    """(ids arrays, their document labels' numbers) of the non-null texts, in order; `name(k)` labels
    text k for errors."""
    tokenizer = settings.tokenizer
    numbered = [(k, text) for k, text in enumerate(texts) if text is not None]
    batched = tokenizer.encode_batch is not None and settings.batch_size > 1
    size = settings.batch_size if batched else max(len(numbered), 1)
    arrays: list[np.ndarray] = []
    for start in range(0, len(numbered), size):
        chunk = numbered[start : start + size]
        chunk_texts = [text for _, text in chunk]
        ids_list = tokenizer.encode_batch(chunk_texts) if batched else [tokenizer.encode(t) for t in chunk_texts]
        for (k, _), ids in zip(chunk, ids_list, strict=True):
            array = np.asarray(ids)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise ValueError(f"{name(k)}: the tokenizer must return a flat list of int ids")
            arrays.append(array)
    return arrays, [k for k, _ in numbered]


def _block(arrays: list[np.ndarray], numbers: list[int], settings: _Settings, name: Any) -> EncodedBlock:
    """The arrays joined with EOS after each non-empty one, their ids checked against the vocabulary."""
    dtype, limit = settings.dtype, settings.limit
    kept = [(array, number) for array, number in zip(arrays, numbers, strict=True) if array.size]
    if not kept:
        return EncodedBlock(np.empty(0, dtype=dtype), np.empty(0, dtype=np.int64))
    flat = np.concatenate([array for array, _ in kept])
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high > limit:
        bad = next(n for a, n in kept if int(a.min()) < 0 or int(a.max()) > limit)
        value = low if low < 0 else high
        raise ValueError(
            f"{name(bad)}: token id {value} is outside [0, {limit}] "
            f"(vocabulary {settings.tokenizer.vocab_size}, dtype {dtype})"
        )
    lengths = np.fromiter((a.size + 1 for a, _ in kept), dtype=np.int64, count=len(kept))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    tokens[ends - 1] = settings.tokenizer.eos_id
    body = np.ones(len(tokens), dtype=bool)
    body[ends - 1] = False
    tokens[body] = flat
    return EncodedBlock(tokens, lengths)


def encode_unit(unit: TextBlock | TableText, settings: _Settings) -> EncodedBlock:
    """One unit's block (see the module docstring)."""
    if isinstance(unit, TextBlock):
        name = lambda k: _label(unit.where, "document", unit.first + k)  # noqa: E731
        arrays, numbers = _encode_texts(list(unit.texts), settings, name)
        return _block(arrays, numbers, settings, name)
    piece = unit.piece
    arrays, numbers, row = [], [], piece.first_row
    name = lambda k: _label(piece.where, "row", k)  # noqa: E731 - k is a row number of the file here
    for batch in read_piece(piece, [unit.column], batch_rows=max(settings.batch_size, 1)):
        part, part_numbers = _encode_texts(batch.column(0).to_pylist(), settings, lambda k, first=row: name(first + k))
        arrays.extend(part)
        numbers.extend(row + k for k in part_numbers)
        row += batch.num_rows
    return _block(arrays, numbers, settings, name)


_worker_settings: _Settings | None = None


def _start_worker(settings: _Settings) -> None:
    global _worker_settings
    # One thread per worker: the pool is the parallelism (a fast tokenizer's own threads would make N
    # workers fight over the cores); tokenizers reads this variable when it encodes.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_settings = settings


def _encode_in_worker(unit: TextBlock | TableText) -> EncodedBlock:
    assert _worker_settings is not None
    return encode_unit(unit, _worker_settings)


def encoded_blocks(units: Iterator[TextBlock | TableText], tokenizer: Any, *, dtype: np.dtype, limit: int,
                   batch_size: int, workers: int = 1) -> Iterator[EncodedBlock]:  # fmt: skip
    """The units' blocks in unit order: encoded here (workers 1) or in `workers` processes."""
    settings = _Settings(tokenizer, np.dtype(dtype), limit, batch_size)
    if workers == 1:
        for unit in units:
            yield encode_unit(unit, settings)
        return
    if "fork" not in multiprocessing.get_all_start_methods():
        raise ValueError("workers > 1 needs the fork start method (Linux, macOS)")
    # fork: the workers start at once with the tokenizer already loaded (nothing is pickled but units
    # and blocks); spawn would re-import torch and transformers in every worker and could not send a
    # tokenizer given as a Python function.
    # concurrent.futures rather than multiprocessing.Pool: a worker that dies (killed, out of memory)
    # fails the run with BrokenProcessPool instead of leaving it waiting forever.
    context = multiprocessing.get_context("fork")
    with _no_tokenizer_threads(), ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                                      initargs=(settings,)) as pool:  # fmt: skip
        pending: collections.deque = collections.deque()
        for unit in units:
            pending.append(pool.submit(_encode_in_worker, unit))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@contextlib.contextmanager
def _no_tokenizer_threads() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false while the pool runs (the previous value back after): a fast
    tokenizer whose thread pool is busy or was used in this process can deadlock in a forked worker;
    the main process encodes nothing meanwhile, so it loses no speed."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def text_blocks(texts: Iterator[str], size: int, where: str = "") -> Iterator[TextBlock]:
    """`texts` cut into blocks of `size` documents, numbered from 0 within `where`."""
    block: list[str] = []
    first = 0
    for text in texts:
        block.append(text)
        if len(block) == size:
            yield TextBlock(tuple(block), first, where)
            first += size
            block = []
    if block:
        yield TextBlock(tuple(block), first, where)

