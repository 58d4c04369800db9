"""A row or a table no format fits: the one line names the key settings with their values (printed as
flags) and the keys or columns the data has (a table's rows hold only the columns asked for, so its
columns are read from the schema)."""

from __future__ import annotations

import pytest

from fntrain.config import ConfigError
from fntrain.data.formats import check_table_formats, fitting_format, no_format_error

FORMATS = [[("data.text_key", "text")], [("data.prompt_key", "question"), ("data.completion_key", "answr")]]


def test_the_first_fitting_format_is_chosen():
    assert fitting_format({"text": "a", "question": "b"}, FORMATS) == 0
    assert fitting_format({"question": "b", "answr": "c"}, FORMATS) == 1
    assert fitting_format({"question": "b", "answer": "c"}, FORMATS) is None


def test_a_row_with_a_mistyped_key_names_the_setting_and_the_row_keys():
    error = no_format_error("data.path 'qa.jsonl' line 1", {"question": "b", "answer": "c"}, FORMATS)
    assert str(error) == (
        "data.path 'qa.jsonl' line 1: cannot tell the format of an example with keys ['answer', 'question']: "
        "data.completion_key 'answr' is not among them; expected data.text_key 'text' or "
        "data.prompt_key 'question' + data.completion_key 'answr'"
    )


def test_a_table_names_all_its_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": ["to be"], "answer": [" or not"]}), path)
    with pytest.raises(ConfigError) as raised:
        check_table_formats("data.path", str(path), FORMATS)
    assert str(raised.value).startswith(
        f"data.path {str(path)!r}: cannot tell the format of its rows, with columns ['answer', 'question']: "
        "data.completion_key 'answr' is not among them"
    )
    check_table_formats("data.path", str(path), [[("data.prompt_key", "question"), ("data.completion_key", "answer")]])
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"x": 1}\n')
    check_table_formats("data.path", str(jsonl), FORMATS)  # JSONL rows are checked one by one
