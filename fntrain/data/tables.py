"""Tabular inputs: Parquet files, Arrow IPC files (as `datasets` writes them) and `datasets.save_to_disk`
folders, read with pyarrow in pieces (never a whole file at once, never a download).

    files = table_files(Path("corpus/"), "input 'corpus/'")   # a folder's .parquet/.arrow files, in order
    require_text_column(files[0], "text", "input 'a.parquet'")  # the column exists and holds strings
    for piece in table_pieces(files[0], "input 'a.parquet'"):  # row groups / runs of record batches
        for batch in read_piece(piece, ["text"]): ...
    rows = read_table_rows("train.parquet", "data.path", ["prompt", "completion"])  # [(label, row), ...]

A save_to_disk folder is told by its `state.json` (or `dataset_info.json`); its Arrow files are read in
the order `state.json` lists them, memory-mapped. A `DatasetDict` folder (`dataset_dict.json`) is refused
with its split names. pyarrow is the `data` extra and is imported inside functions only, so the text and
JSONL paths never need it. Every problem is a `fntrain.config.ConfigError` starting with `where` (the
setting and the path as the user typed them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.config import ConfigError

__all__ = [
    "TABLE_SUFFIXES",
    "TablePiece",
    "is_table_source",
    "is_dataset_folder",
    "table_files",
    "table_columns",
    "require_text_column",
    "table_pieces",
    "read_piece",
    "read_table_rows",
    "count_table_rows",
]

TABLE_SUFFIXES = (".parquet", ".arrow")
_DATASET_MARKS = ("state.json", "dataset_info.json")
ARROW_PIECE_BYTES = 32 << 20
"""Record batches of an Arrow file are grouped into pieces of about this many bytes (a Parquet piece is
one row group): what one tokenizing worker holds at a time."""


@dataclass(frozen=True)
class TablePiece:
    """A deterministic part of one table file: Parquet row groups [start, stop), or Arrow record batches
    [start, stop); `first_row` is the file's row number of its first row (for error messages)."""

    path: Path
    start: int
    stop: int
    first_row: int
    where: str


def _pyarrow() -> Any:
    try:
        import pyarrow  # noqa: F401 - the data extra
        import pyarrow.ipc
        import pyarrow.parquet
    except ModuleNotFoundError:
        raise ConfigError("reading Parquet/Arrow inputs needs pyarrow: pip install 'fntrain[data]'") from None
    return pyarrow


def is_dataset_folder(path: Path) -> bool:
    """A `datasets.save_to_disk` folder (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / mark).is_file() for mark in (*_DATASET_MARKS, "dataset_dict.json"))


def is_table_source(path: Path) -> bool:
    """A Parquet/Arrow file, a save_to_disk folder, or a folder holding .parquet/.arrow files."""
    if path.is_file():
        return path.suffix in TABLE_SUFFIXES
    return path.is_dir() and (is_dataset_folder(path) or any(_folder_tables(path)))


def _folder_tables(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TABLE_SUFFIXES)


def _saved_files(folder: Path, where: str) -> list[Path]:
    """The Arrow files of a save_to_disk folder in state.json's order (else sorted)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError):
            splits = []
        raise ConfigError(
            f"{where} is a DatasetDict folder (splits: {', '.join(map(str, splits)) or '?'}): "
            f"name one split's folder, e.g. {str(folder / (splits[0] if splits else 'train'))!r}"
        )
    state = folder / "state.json"
    if state.is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{where}: state.json is not a datasets state file ({error})") from None
        files = [folder / name for name in names]
        missing = [name for name, file in zip(names, files, strict=True) if not file.is_file()]
        if missing:
            raise ConfigError(f"{where}: state.json lists {missing[0]!r}, which is not in the folder")
        return files
    return sorted(folder.glob("*.arrow"))


def table_files(path: Path, where: str) -> list[Path]:
    """The table files `path` stands for, in order: itself, a save_to_disk folder's Arrow files, or a
    folder's .parquet/.arrow files (recursively, sorted)."""
    if path.is_file():
        return [path]
    files = _saved_files(path, where) if is_dataset_folder(path) else _folder_tables(path)
    if not files:
        raise ConfigError(f"{where} holds no .parquet or .arrow files")
    return files


def _open_arrow(path: Path, where: str) -> Any:
    """A reader over the memory-mapped Arrow IPC file: the random-access file format, else the stream
    format (what `datasets` writes)."""
    pa = _pyarrow()
    try:
        source = pa.memory_map(str(path))
        try:
            return pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            return pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as error:
        raise ConfigError(f"{where} is not a readable Arrow IPC file ({_first_line(error)})") from None


def _open_parquet(path: Path, where: str) -> Any:
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(str(path))
    except (pa.ArrowException, OSError) as error:
        raise ConfigError(f"{where} is not a readable Parquet file ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _schema(path: Path, where: str) -> Any:
    if path.suffix == ".parquet":
        return _open_parquet(path, where).schema_arrow
    return _open_arrow(path, where).schema


def table_columns(path: Path, where: str) -> dict[str, str]:
    """{column name: its Arrow type} of a table file, from its schema alone."""
    return {field.name: str(field.type) for field in _schema(path, where)}


def require_text_column(path: Path, column: str, where: str) -> None:
    """The file has `column` and it holds strings; else a `ConfigError` naming the file, the column and
    the columns present (or the column's type)."""
    pa = _pyarrow()
    schema = _schema(path, where)
    if column not in schema.names:
        raise ConfigError(f"{where} has no column {column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ConfigError(f"{where} column {column!r} holds {kind}, not strings")


def table_pieces(path: Path, where: str) -> list[TablePiece]:
    """The file cut into pieces, from its metadata alone: one per Parquet row group; runs of Arrow record
    batches of about ARROW_PIECE_BYTES. A pure function of the file."""
    if path.suffix == ".parquet":
        metadata = _open_parquet(path, where).metadata
        pieces, row = [], 0
        for group in range(metadata.num_row_groups):
            pieces.append(TablePiece(path, group, group + 1, row, where))
            row += metadata.row_group(group).num_rows
        return pieces
    pieces, start, count, row, first, size = [], 0, 0, 0, 0, 0
    for batch in _arrow_batches(_open_arrow(path, where), where):
        count, row, size = count + 1, row + batch.num_rows, size + batch.nbytes  # sizes, not data
        if size >= ARROW_PIECE_BYTES:
            pieces.append(TablePiece(path, start, count, first, where))
            start, first, size = count, row, 0
    if start < count:
        pieces.append(TablePiece(path, start, count, first, where))
    return pieces


def _arrow_batches(reader: Any, where: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
    pa = _pyarrow()
    try:
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            for index in range(start, reader.num_record_batches if stop is None else stop):
                yield reader.get_batch(index)
            return
        for index, batch in enumerate(reader):  # a stream: skipping a memory-mapped batch touches no data
            if stop is not None and index >= stop:
                return
            if index >= start:
                yield batch
    except pa.ArrowException as error:
        raise ConfigError(f"{where} cannot be read ({_first_line(error)})") from None


def read_piece(piece: TablePiece, columns: Sequence[str], batch_rows: int = 1024) -> Iterator[Any]:
    """The piece's record batches of `columns`, in order (Parquet: `batch_rows` rows each)."""
    pa = _pyarrow()
    try:
        if piece.path.suffix == ".parquet":
            parquet = _open_parquet(piece.path, piece.where)
            groups = list(range(piece.start, piece.stop))
            yield from parquet.iter_batches(batch_size=batch_rows, row_groups=groups, columns=list(columns))
            return
        reader = _open_arrow(piece.path, piece.where)
        for batch in _arrow_batches(reader, piece.where, piece.start, piece.stop):
            yield batch.select(list(columns))
    except pa.ArrowException as error:
        raise ConfigError(f"{piece.where} cannot be read ({_first_line(error)})") from None


def read_table_rows(
    path: str, field_name: str, columns: Sequence[str] | None
) -> list[tuple[str, dict[str, Any]]]:
    """Every row of a table source as (its label, e.g. "row 0" or "b.parquet row 3" when the source has
    several files; {column: value} for those of `columns` the table has, every column when None, null
    cells left out), read in full. A source with none of `columns` is a `ConfigError` naming them and the
    columns present."""
    source = Path(path).expanduser()
    where = f"{field_name} {path!r}"
    files = table_files(source, where)
    rows: list[tuple[str, dict[str, Any]]] = []
    for file in files:
        file_where = where if len(files) == 1 else f"{where} file {file.name!r}"
        present = table_columns(file, file_where)
        wanted = list(present) if columns is None else [c for c in dict.fromkeys(columns) if c in present]
        if not wanted and columns is not None:
            raise ConfigError(f"{file_where} has none of the columns {', '.join(map(repr, columns))} "
                              f"(columns: {', '.join(present)})")  # fmt: skip
        prefix = "" if len(files) == 1 else f"{file.name} "
        number = 0
        for piece in table_pieces(file, file_where):
            for batch in read_piece(piece, wanted):
                for row in batch.to_pylist():
                    rows.append((f"{prefix}row {number}", {k: v for k, v in row.items() if v is not None}))
                    number += 1
    if not rows:
        raise ConfigError(f"{where} is empty: it holds no rows")
    return rows


def count_table_rows(path: str, field_name: str) -> int:
    """The number of rows of a table source, from metadata (Parquet) or batch headers (Arrow)."""
    source = Path(path).expanduser()
    where = f"{field_name} {path!r}"
    total = 0
    for file in table_files(source, where):
        if file.suffix == ".parquet":
            total += _open_parquet(file, where).metadata.num_rows
        else:
            total += sum(batch.num_rows for batch in _arrow_batches(_open_arrow(file, where), where))
    return total
