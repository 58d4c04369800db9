"""The inputs of `fntrain tokenize`: which files, the documents they hold, checked before any work, and
cut into the units the workers encode.

`.jsonl` (one JSON object per line; its `text_key` field is a document), `.txt` (the whole file, each
line, or each blank-line separated paragraph is a document: `split`), either optionally gzipped;
`.parquet` and Arrow IPC `.arrow` files (each row's `text_key` column is a document; a null is none) and
`datasets.save_to_disk` folders (their Arrow files, memory-mapped: `fntrain.data.tables`); a directory
stands for its matching files, recursively, in sorted order.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from fntrain.config import ConfigError, require_choice
from fntrain.data.files import jsonl_rows, open_text
from fntrain.data.tables import (
    TABLE_SUFFIXES,
    is_dataset_folder,
    read_piece,
    require_text_column,
    table_files,
    table_pieces,
)
from fntrain.data.tokenize_pool import TableText, TextBlock, text_blocks

__all__ = ["SPLITS", "input_files", "read_documents", "check_inputs", "work_units"]

SPLITS = ("file", "line", "paragraph")
_TEXT_SUFFIXES = (".txt", ".jsonl")
_INPUT_SUFFIXES = (*_TEXT_SUFFIXES, *TABLE_SUFFIXES)


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


def check_inputs(files: Sequence[Path], text_key: str, split: str) -> None:
    """Phase 1 of a tokenization: every table's schema has a string `text_key` column and its metadata
    reads (for all of them, before any text is read); then every text/JSONL file is read through."""
    for path in files:
        if _is_table(path):
            require_text_column(path, text_key, f"input {str(path)!r}")
            table_pieces(path, f"input {str(path)!r}")
    for path in files:
        if not _is_table(path):
            collections.deque(_file_documents(path, text_key, split), maxlen=0)


def work_units(files: Sequence[Path], text_key: str, split: str, batch_size: int) -> Iterator[TextBlock | TableText]:
    """The files' deterministic units, in input order: each table piece, and blocks of `batch_size`
    documents of each text/JSONL file."""
    for path in files:
        where = f"input {str(path)!r}"
        if _is_table(path):
            yield from (TableText(piece, text_key) for piece in table_pieces(path, where))
        else:
            yield from text_blocks(_file_documents(path, text_key, split), batch_size, where)
