"""fntrain.data.byte_windows: a text file as byte windows, its tail held out, sizes from the file alone."""

from __future__ import annotations

import pytest

from fntrain.config import ConfigError
from fntrain.data.byte_windows import byte_window_counts, byte_windows


def test_windows_split_the_tail_off_and_counts_match(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(100)))
    train, val = byte_windows(path, context=8, val_fraction=0.2)
    assert (len(train), len(val)) == byte_window_counts(path, 8, 0.2) == (10, 2)
    assert train[1]["input_ids"].tolist() == list(range(8, 16)) == train[1]["labels"].tolist()
    assert val[0]["input_ids"].tolist() == list(range(80, 88))


@pytest.mark.parametrize("make, needle", [(lambda p: p.write_bytes(b""), "is empty"), (lambda p: p.mkdir(), "directory")])
def test_an_empty_file_or_a_directory_names_the_field(tmp_path, make, needle):
    path = tmp_path / "corpus.txt"
    make(path)
    for read in (byte_windows, byte_window_counts):
        with pytest.raises(ConfigError, match=f"data.path .*corpus.txt.* {needle}"):
            read(path, 8, 0.1)


def test_a_file_too_small_for_one_training_window_names_the_field_and_the_context(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 10)  # 9 bytes for training after the tail: less than a 16-byte window
    for read in (byte_windows, byte_window_counts):
        with pytest.raises(ConfigError, match=r"data.path .*short.txt' holds 10 bytes, 9 of them .* model.context \(16\)"):
            read(path, 16, 0.1)
