"""Input files the tests write the way a user's would be: JSONL rows, Parquet tables, and the hashes that
show a command left a directory as it was."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """`rows` as JSON lines at `path`; returns the path as a string (as a config field takes it)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def file_hashes(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones too), by its path relative to `root` -> its content's sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def file_hashes_and_siblings(root: Path) -> dict[str, str]:
    """`file_hashes(root)`, and under ".." the names beside `root` (a command must not make one there)."""
    return {**file_hashes(root), "..": ",".join(sorted(p.name for p in root.parent.iterdir()))}


def tree_hashes(root: Path) -> dict[str, str]:
    """Every path under `root`, in order: a file -> its content's sha256, a directory -> "<dir>"."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        for p in sorted(root.rglob("*"))
    }


def write_file(path: Path, data: str | bytes) -> str:
    """`data` at `path` (its folders made); returns the path as a string."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def relative_paths(root: Path) -> list[str]:
    """Every path under `root` (files and folders), relative to it, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def write_row_formats(root: Path, rows: list[dict]) -> dict[str, str]:
    """`rows` written under `root` in every form fntrain reads rows from, by name -> the path as a config
    field takes it: JSONL, gzipped JSONL, Parquet (row groups of two rows), a folder of two Parquet
    files, an Arrow IPC file (record batches of two rows) and a `datasets.save_to_disk` folder (two
    shards). Each holds the rows in the same order; a table has a column for every key of any row, null
    where a row has no such key (pyarrow's `from_pylist` and `Dataset.from_list` take the first row's keys
    alone)."""
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    keys = dict.fromkeys(key for row in rows for key in row)
    table = pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows])
    with gzip.open(root / "rows.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
    pq.write_table(table, root / "rows.parquet", row_group_size=2)
    (root / "parts").mkdir()
    half = len(rows) // 2
    pq.write_table(table.slice(0, half), root / "parts" / "part-0.parquet")
    pq.write_table(table.slice(half), root / "parts" / "part-1.parquet")
    with pa.ipc.new_file(str(root / "rows.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    datasets.Dataset(table).save_to_disk(str(root / "saved"), num_shards=2)
    return {
        "jsonl": write_jsonl(root / "rows.jsonl", rows),
        "jsonl.gz": str(root / "rows.jsonl.gz"),
        "parquet": str(root / "rows.parquet"),
        "parquet folder": str(root / "parts"),
        "arrow": str(root / "rows.arrow"),
        "save_to_disk": str(root / "saved"),
    }
