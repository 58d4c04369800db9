"""Files named by a setting, checked with errors a user can act on; JSONL (optionally gzipped, one
JSON object per line) read whole or streamed; rows of JSONL or of tables (Parquet, Arrow, save_to_disk
folders: `fntrain.data.tables`) read alike.

    file = require_file("data.path", config.data.path)      # exists and is a file, else one clear line
    parent = existing_ancestor(Path(out), "output")         # where a new output directory would go
    rows = read_jsonl_rows("train.jsonl", "data.path")       # [(line number, object), ...], whole file
    for number, row in jsonl_rows(path, "input 'a.jsonl'"):  # streamed, for files too big to hold
    source = require_source("data.path", config.data.path)  # a file, or a table folder
    rows = read_rows("train.parquet", "data.path", ["prompt", "completion"])  # [("row 0", {...}), ...]

Every problem is a `fntrain.config.ConfigError` (the command line prints it as one line, exit status 2)
that starts with the field and the file as the user typed it, and names the line:
`data.path 'x.jsonl' line 3: not JSON (Expecting value: column 1)`. A missing file, a directory, an
empty file, text that is not UTF-8 and a `.gz` file that is not gzip are each said as such.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from fntrain.config import ConfigError, absent_input, require_float, require_str
from fntrain.data.tables import count_table_rows, is_table_source, read_table_rows

__all__ = [
    "open_text",
    "require_file",
    "require_source",
    "require_split",
    "held_out_tail",
    "existing_ancestor",
    "jsonl_rows",
    "read_jsonl_rows",
    "read_rows",
    "count_rows",
    "position_label",
]


def require_file(field_name: str, path: str) -> Path:
    """`path` (as typed, `~` expanded) when it is an existing file; else a `ConfigError` saying whether
    it is missing or a directory. A missing file passes inside `fntrain.config.inputs_optional()`."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise ConfigError(f"{field_name} {path!r} is a directory, not a file")
    if not file.is_file() and not absent_input(f"{field_name} {path!r} does not exist"):
        raise ConfigError(f"{field_name} {path!r} does not exist")
    return file


def existing_ancestor(path: Path, field_name: str = "output") -> Path:
    """The nearest ancestor of `path` that exists: where creating `path` starts (and where a staging
    directory beside it can go). One that is a file is a `FileExistsError` naming `field_name`, `path`
    and that file."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise FileExistsError(f"{field_name} {str(path)!r} cannot be created: {str(parent)!r} is a file")
    return parent


def open_text(path: Path) -> TextIO:
    """`path` opened for reading UTF-8 text, through gzip when its name ends in `.gz`."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")  # noqa: SIM115 - closed by the caller's `with`


def _parse(line: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: not JSON ({error.msg}: column {error.colno})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__} {_short(record)}")
    return record


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def jsonl_rows(path: str | Path, where: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of the file `path`, as it is read. `where` starts
    every error (e.g. "data.path 'x.jsonl'"): a line that is not a JSON object, bytes that are not
    UTF-8, a `.gz` that is not gzip."""
    try:
        with open_text(Path(path).expanduser()) as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, _parse(line, f"{where} line {number}")
    except UnicodeDecodeError:  # text is decoded in chunks: the line is not known, only the file
        raise ConfigError(f"{where} is not UTF-8 text (a binary file?)") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise ConfigError(f"{where}: not a readable gzip file ({error})") from None


def read_jsonl_rows(path: str, field_name: str = "data.path") -> list[tuple[int, dict[str, Any]]]:
    """Every (line number, object) of the JSONL file `path`, read in full; a `ConfigError` naming
    `field_name` and `path` when it is missing, a directory, empty, or has a bad line."""
    file = require_file(field_name, path)
    where = f"{field_name} {path!r}"
    rows = list(jsonl_rows(file, where))
    if not rows:
        raise ConfigError(f"{where} is empty: expected one JSON object per line")
    return rows


def require_source(field_name: str, path: str) -> Path:
    """`path` (`~` expanded) when it is an existing file, a `datasets.save_to_disk` folder or a folder
    of .parquet/.arrow files; else a `ConfigError` saying what it is."""
    source = Path(path).expanduser()
    if source.is_dir() and is_table_source(source):
        return source
    if source.is_dir():
        raise ConfigError(
            f"{field_name} {path!r} is a directory, not a file (nor a folder of .parquet/.arrow files or a "
            "datasets.save_to_disk dataset)"
        )
    return require_file(field_name, path)


def require_split(prefix: str, path: str, val_path: str | None, val_fraction: float) -> None:
    """A data section's sources: `path` and, when set, `val_path` (files or table folders), and a held-out
    `val_fraction` in [0, 0.5]; each problem a `ValueError`/`ConfigError` naming `prefix.<field>`."""
    require_str(f"{prefix}.val_path", val_path, optional=True)
    require_float(f"{prefix}.val_fraction", val_fraction, min=0.0, max=0.5)
    require_source(f"{prefix}.path", path)
    if val_path:
        require_source(f"{prefix}.val_path", val_path)


def held_out_tail(items: list[Any], val_fraction: float, what: str) -> tuple[list[Any], list[Any]]:
    """(train, validation): the last `val_fraction` of `items` held out in order, at least one; a
    fraction that leaves no training item is a `ConfigError` saying so (`what`: the training item, as
    the message names it)."""
    split = len(items) - max(1, int(len(items) * val_fraction))
    if split < 1:
        raise ConfigError(f"data.val_fraction {val_fraction} leaves no training {what}")
    return items[:split], items[split:]


def read_rows(
    path: str, field_name: str, columns: Sequence[str] | None
) -> list[tuple[int | str, dict[str, Any]]]:
    """Every row of a JSONL file (position: its line number) or of a table source (position: "row N",
    0-based, as `datasets` indexes it; only `columns`, all of them when None, null cells left out), read
    in full; errors as `read_jsonl_rows` / `fntrain.data.tables.read_table_rows`."""
    source = require_source(field_name, path)
    if is_table_source(source):
        return list(read_table_rows(path, field_name, columns))
    return list(read_jsonl_rows(path, field_name))


def count_rows(path: str, field_name: str) -> int:
    """The number of rows `read_rows` gives, from table metadata where it can."""
    source = require_source(field_name, path)
    if is_table_source(source):
        return count_table_rows(path, field_name)
    return len(read_jsonl_rows(path, field_name))


def position_label(position: int | str) -> str:
    """How an error names a row at `position` of `read_rows`: "line 3" or "row 2"."""
    return f"line {position}" if isinstance(position, int) else position
