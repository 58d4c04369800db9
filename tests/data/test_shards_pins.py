"""Pins for fntrain/data/shards.py found by mutation testing: exact ranges across shard boundaries and
empty/one-token shards, document offsets, windows and their split, release accounting, pickling, and the
exact one-line errors (see docs/mutation.md)."""

from __future__ import annotations

import os
import pickle
import re
import warnings

import numpy as np
import pytest
import torch

from fntrain.config import ConfigError
from fntrain.data.shard_index import ShardIndex, ShardInfo, read_index, write_index
from fntrain.data.shards import (
    TokenDocuments,
    TokenShards,
    TokenWindows,
    check_shard_vocab,
    open_shards,
    split_windows,
)
from tests.data.test_shards import EOS, documents, write_corpus


def hand_shards(directory, sizes, *, vocab_size=1000, documents_bin=False, first=None):
    """Shards of the given token counts (zero and one included) holding 1, 2, 3, ... in order, and the
    stream; `first` replaces the first token; `documents_bin` writes an empty document index."""
    stream = np.arange(1, sum(sizes) + 1, dtype=np.uint16)
    if first is not None:
        stream[0] = first
    infos, offset = [], 0
    for number, size in enumerate(sizes):
        stream[offset : offset + size].tofile(directory / f"shard_{number:05d}.bin")
        infos.append(ShardInfo(f"shard_{number:05d}.bin", size))
        offset += size
    extra = {}
    if documents_bin:
        (directory / "documents.bin").write_bytes(b"")
        extra = {"documents": 0, "document_index": "documents.bin"}
    write_index(ShardIndex(directory, "<u2", tuple(infos), eos_id=EOS, vocab_size=vocab_size, **extra))
    return stream


def test_every_range_reads_the_tokens_written_across_empty_and_one_token_shards(tmp_path):
    stream = hand_shards(tmp_path, [3, 0, 1, 4, 0, 1, 2])
    shards = open_shards(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for start in range(len(stream) + 1):
            for stop in range(start, len(stream) + 1):
                got = shards.read(start, stop)
                assert got.dtype == np.dtype("<u2")
                assert got.tolist() == stream[start:stop].tolist()
        shards.close()
        assert shards.read(2, 6).tolist() == stream[2:6].tolist()  # a later read maps them again
        shards.close()
    # Each shard file is opened once and closed by close(): nothing is left for the collector to close.
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_a_range_outside_the_stream_is_one_line_naming_it(tmp_path):
    hand_shards(tmp_path, [3, 4])
    shards = open_shards(tmp_path)
    for start, stop in ((0, 8), (5, 4), (-1, 2)):
        with pytest.raises(
            IndexError, match=rf"^token range \[{start}, {stop}\) is outside the shards' \[0, 7\)$"
        ):
            shards.read(start, stop)


def test_repr_names_directory_shards_tokens_and_dtype(tmp_path):
    hand_shards(tmp_path, [3, 4])
    assert repr(open_shards(tmp_path)) == f"TokenShards({str(tmp_path)!r}, shards=2, tokens=7, dtype=uint16)"


def test_release_bytes_is_checked_in_one_line(tmp_path):
    hand_shards(tmp_path, [4])
    index = read_index(tmp_path)
    assert TokenShards(index, release_bytes=1).release_bytes == 1
    for bad in (0, -3, 1.5, True, "8"):
        with pytest.raises(
            ValueError, match=f"^release_bytes must be a positive int or None, got {re.escape(repr(bad))}$"
        ):
            TokenShards(index, release_bytes=bad)


def _count_releases(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = TokenShards.release

    def counting(self):
        calls.append(1)
        original(self)

    monkeypatch.setattr(TokenShards, "release", counting)
    return calls


def test_pages_are_released_after_each_release_bytes_read(tmp_path, monkeypatch):
    hand_shards(tmp_path, [40])
    calls = _count_releases(monkeypatch)
    shards = open_shards(tmp_path, release_bytes=8)  # 4 uint16 tokens
    shards.read(0, 3)  # 6 bytes
    assert calls == []
    shards.read(3, 4)  # 8 bytes: exactly release_bytes
    assert len(calls) == 1
    shards.read(4, 7)  # 6 bytes since the release
    assert len(calls) == 1
    shards.read(7, 8)  # 8
    assert len(calls) == 2
    odd = open_shards(tmp_path, release_bytes=9)
    odd.read(0, 4)  # 8 bytes < 9
    assert len(calls) == 2
    odd.read(4, 5)
    assert len(calls) == 3
    odd.read(5, 9)  # 8 bytes since that release: below 9 again
    assert len(calls) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork, as DataLoader workers on Linux")
def test_a_forked_worker_counts_its_own_reads_from_zero(tmp_path, monkeypatch):
    stream = hand_shards(tmp_path, [40])
    calls = _count_releases(monkeypatch)
    shards = open_shards(tmp_path, release_bytes=7)
    shards.read(0, 3)  # 6 bytes in the parent, which has now mapped the shard
    pid = os.fork()
    if pid == 0:  # the worker: 6 more bytes are its first 6, below release_bytes
        code = 3
        try:
            code = 0 if shards.read(3, 6).tolist() == stream[3:6].tolist() and not calls else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert calls == []


def test_a_pickled_shards_reads_the_same_and_counts_from_zero(tmp_path, monkeypatch):
    write_corpus(tmp_path, documents(12), shard_tokens=50)
    calls = _count_releases(monkeypatch)
    shards = open_shards(tmp_path, release_bytes=7)
    shards.read(0, 3)  # 6 bytes, not yet released
    size = len(pickle.dumps(shards))
    offsets = shards.document_offsets().tolist()
    assert len(pickle.dumps(shards)) == size  # pickling carries no mapped document offsets
    copy = pickle.loads(pickle.dumps(shards))
    assert copy.document_offsets().tolist() == offsets
    copy.read(3, 6)  # 6 bytes in the copy: below release_bytes
    assert calls == []
    assert copy.read(0, len(copy)).tolist() == shards.read(0, len(shards)).tolist()


def test_document_offsets_are_read_only_int64_and_survive_close(tmp_path):
    docs = documents(12)
    write_corpus(tmp_path, docs, shard_tokens=50)
    shards = open_shards(tmp_path)
    offsets = shards.document_offsets()
    expected = np.cumsum([0] + [len(d) + 1 for d in docs[:-1]]).tolist()
    assert offsets.dtype == np.int64 and offsets.tolist() == expected
    with pytest.raises(ValueError):
        offsets[0] = 5  # mapped read-only
    shards.close()
    assert shards.document_offsets().tolist() == expected
    as_documents = TokenDocuments(shards)
    assert len(as_documents) == 12
    assert as_documents[11].dtype == torch.int64 and as_documents[11].tolist() == docs[11] + [EOS]
    for bad in (12, -1):
        with pytest.raises(IndexError, match=rf"^document {bad} is outside \[0, 12\)$"):
            shards.document_range(bad)


def test_an_index_of_no_documents_has_no_offsets(tmp_path):
    hand_shards(tmp_path, [3, 4], documents_bin=True)
    shards = open_shards(tmp_path)
    offsets = shards.document_offsets()
    assert offsets.dtype == np.int64 and offsets.tolist() == []
    as_documents = TokenDocuments(shards)
    assert len(as_documents) == 0 and as_documents.lengths().tolist() == []


def test_shards_without_a_document_index_say_so_in_one_line(tmp_path):
    hand_shards(tmp_path, [3, 4])
    with pytest.raises(
        ValueError, match=f"^the shards at {re.escape(repr(str(tmp_path)))} have no document index$"
    ):
        TokenDocuments(tmp_path)


# ----------------------------------------------------------------------------- windows


def test_window_arguments_are_checked_in_one_line(tmp_path):
    hand_shards(tmp_path, [3, 4])
    cases = [
        ({"context": 0}, ValueError, "context must be >= 1, got 0"),
        ({"context": "4"}, TypeError, "context must be an int, got '4'"),
        ({"context": 2, "stride": 0}, ValueError, "stride must be >= 1, got 0"),
        ({"context": 2, "stride": 1.0}, TypeError, "stride must be an int, got 1.0"),
        (
            {"context": 8},
            ValueError,
            f"the shards at {str(tmp_path)!r} hold 7 tokens, fewer than one context of 8",
        ),
    ]
    for kwargs, error, message in cases:
        context = kwargs.pop("context")
        with pytest.raises(error, match=f"^{re.escape(message)}$"):
            TokenWindows(tmp_path, context, **kwargs)


def test_windows_tile_the_stream_and_index_from_the_end(tmp_path):
    stream = hand_shards(tmp_path, [3, 4])
    exact = TokenWindows(tmp_path, 7)  # a corpus of exactly one context is one window
    assert len(exact) == 1 and exact[0]["input_ids"].tolist() == stream.tolist()
    ones = TokenWindows(tmp_path, 1, stride=1)
    assert [ones[i]["input_ids"].tolist() for i in range(len(ones))] == [[t] for t in stream.tolist()]
    windows = TokenWindows(tmp_path, 3, stride=2)  # 0-3, 2-5, 4-7
    assert len(windows) == 3
    assert windows[-1]["input_ids"].tolist() == stream[4:7].tolist()
    assert windows[-3]["input_ids"].tolist() == stream[0:3].tolist()
    for bad, shown in ((3, 3), (-4, -1), (-7, -4)):
        with pytest.raises(IndexError, match=rf"^window {shown} is outside \[0, 3\)$"):
            windows[bad]


def test_split_windows_holds_out_the_tail(tmp_path):
    hand_shards(tmp_path, [6, 4])
    windows = TokenWindows(tmp_path, 1)  # 10 windows
    for fraction, cut in ((0.2, 8), (0.5, 5), (0.0, 10)):
        train, validation = split_windows(windows, fraction)
        assert len(train) == cut and len(validation) == 10 - cut
        rows = [s["input_ids"].tolist() for part in (train, validation) for s in part]
        assert rows == [windows[i]["input_ids"].tolist() for i in range(10)]


# ----------------------------------------------------------------------------- vocabulary check


def test_vocab_check_reads_every_id_once_when_the_index_names_no_vocabulary(tmp_path, monkeypatch):
    hand_shards(tmp_path, [3, 4], vocab_size=None, first=900)  # the largest id is the very first token
    read_tokens: list[int] = []
    original = TokenShards.read

    def counting(self, start, stop):
        read_tokens.append(stop - start)
        return original(self, start, stop)

    monkeypatch.setattr(TokenShards, "read", counting)
    check_shard_vocab("data.shards", str(tmp_path), 901)
    assert sum(read_tokens) == 7
    with pytest.raises(ConfigError) as error:
        check_shard_vocab("data.shards", str(tmp_path), 900)
    assert str(error.value) == (
        f"data.shards {str(tmp_path)!r} holds token ids up to 900 (tokenizer None) but the model's "
        "vocabulary has 900: tokenize with the model's tokenizer (fntrain tokenize ... --tokenizer MODEL_DIR)"
    )


def test_vocab_check_names_the_field_for_a_missing_directory(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"^data.shards {re.escape(repr(missing))} does not exist$"):
        check_shard_vocab("data.shards", missing, 1000)
