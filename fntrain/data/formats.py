"""The one line when a row fits none of a recipe's row formats: the keys settings (their fields and
values, which the command line prints as flags) and the keys or columns the row or file has.

    formats = [[("data.text_key", "text")], [("data.prompt_key", "q"), ("data.completion_key", "a")]]
    if fitting_format(row, formats) is None: raise no_format_error("data.path 'x.jsonl' line 1", row, formats)
    check_table_formats("data.path", "x.parquet", formats)   # a table's columns, checked up front
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from fntrain.config import ConfigError
from fntrain.data.tables import is_table_source, table_columns, table_files

__all__ = ["Format", "fitting_format", "no_format_error", "check_table_formats"]

# A format is the keys a row of it must have, each as (its setting's dotted field, the key set there).
Format = Sequence[tuple[str, str]]


def fitting_format(keys: Collection[str], formats: Sequence[Format]) -> int | None:
    """The index of the first format whose keys are all in `keys`, or None."""
    return next((index for index, keys_of in enumerate(formats) if all(k in keys for _, k in keys_of)), None)


def no_format_error(
    where: str, keys: Collection[str], formats: Sequence[Format], subject: str = "an example with keys"
) -> ConfigError:
    """"`where`: cannot tell the format of `subject` [...]": each format as its settings and values;
    when a format has some of its keys, the settings whose keys are missing are named first."""
    partial = [
        f"{field} {key!r}" for keys_of in formats if any(k in keys for _, k in keys_of)
        for field, key in keys_of if key not in keys
    ]  # fmt: skip
    each = [" + ".join(f"{field} {key!r}" for field, key in keys_of) for keys_of in formats]
    expected = each[0] if len(each) == 1 else f"{', '.join(each[:-1])} or {each[-1]}"
    missing = f"{', '.join(partial)} {'is' if len(partial) == 1 else 'are'} not among them; " if partial else ""
    return ConfigError(f"{where}: cannot tell the format of {subject} {sorted(keys)}: {missing}expected {expected}")


def check_table_formats(field_name: str, path: str, formats: Sequence[Format], fixed: int | None = None) -> None:
    """For a table source (Parquet, Arrow, a save_to_disk folder): some format (`fixed`: that one)
    has all its columns in every file, else the one line naming the settings and the file's columns.
    A JSONL file passes: its rows are checked one by one."""
    source = Path(path).expanduser()
    if not is_table_source(source):
        return
    where = f"{field_name} {path!r}"
    files = table_files(source, where)
    for file in files:
        file_where = where if len(files) == 1 else f"{where} file {file.name!r}"
        columns = set(table_columns(file, file_where))
        chosen = formats if fixed is None else [formats[fixed]]
        if fitting_format(columns, chosen) is None:
            raise no_format_error(file_where, columns, chosen, subject="its rows, with columns")
