"""Memory-mapped token shards: windows over the concatenated stream, exact cursor resume across shard
boundaries, DataLoader workers, and flat memory while an epoch walks the corpus (issue 12, item 4)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from fntrain import RunPlan, StopTraining, TrainState, train
from fntrain.data.pipeline import batches, build_data, data_fn, steps_per_epoch
from fntrain.data.settings import Batching, LoaderConfig
from fntrain.data.shard_index import INDEX_NAME, ShardIndex, ShardInfo, read_index, write_index
from fntrain.data.shards import (
    TokenDocuments,
    TokenShards,
    TokenWindows,
    check_shard_vocab,
    open_shards,
    require_shards,
)
from fntrain.data.tokenize import TokenizeSettings, tokenize_documents

EOS = 0


def documents(count: int, seed: int = 0) -> list[list[int]]:
    """Documents of ids 1..999 with random lengths (EOS 0 never inside a document)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, size=int(rng.integers(1, 60))).tolist() for _ in range(count)]


def write_corpus(directory: Path, docs: list[list[int]], *, shard_tokens: int, format: str = "bin"):
    """Shards of `docs` (the tokenizer decodes a doc's ids from its text) and the reference stream."""
    texts = [" ".join(map(str, doc)) for doc in docs]
    tokenize_documents(
        texts, directory, lambda text: [int(t) for t in text.split()], eos_id=EOS, vocab_size=1000,
        settings=TokenizeSettings(shard_tokens=shard_tokens, format=format),
    )  # fmt: skip
    stream = np.concatenate([np.asarray(doc + [EOS]) for doc in docs])
    return stream


def read_token_rows(iterator) -> list[list[list[list[int]]]]:
    """Consume (and close) a `batches` iterator: each step as its micro-batches' token rows."""
    try:
        return [[mb["input_ids"].tolist() for mb in step] for step in iterator]
    finally:
        iterator.close()


# ----------------------------------------------------------------------------- the stream and its windows


@pytest.mark.parametrize("format", ["bin", "npy"])
def test_windows_are_the_concatenated_stream_across_shards(tmp_path, format):
    stream = write_corpus(tmp_path, documents(40), shard_tokens=97, format=format)
    index = read_index(tmp_path)
    assert index.total_tokens == len(stream) and len(index.shards) == -(-len(stream) // 97)
    assert all(s.tokens == 97 for s in index.shards[:-1]) and index.dtype == "<u2"
    for stride in (None, 15):
        windows = TokenWindows(tmp_path, 16, stride=stride)
        step = stride or 16
        assert len(windows) == (len(stream) - 16) // step + 1
        for i in range(len(windows)):
            sample = windows[i]
            assert sample["input_ids"].dtype == torch.int64
            assert sample["input_ids"].tolist() == stream[i * step : i * step + 16].tolist()
            assert sample["labels"] is sample["input_ids"]  # the loss shifts them
    spanning = [i for i in range(len(windows)) if (i * 15) // 97 != (i * 15 + 15) // 97]
    assert spanning  # some windows straddle two shards
    shards = open_shards(tmp_path)
    assert shards.read(90, 300).tolist() == stream[90:300].tolist()  # spans three shards
    with pytest.raises(IndexError):
        shards.read(0, len(stream) + 1)
    with pytest.raises(IndexError):
        windows[len(windows)]


def test_documents_come_from_the_document_index(tmp_path):
    docs = documents(12)
    write_corpus(tmp_path, docs, shard_tokens=50)
    shards = open_shards(tmp_path)
    assert shards.eos_id == EOS and shards.vocab_size == 1000
    as_documents = TokenDocuments(shards)
    assert len(as_documents) == 12
    assert as_documents.lengths().tolist() == [len(d) + 1 for d in docs]
    assert shards.tokens_read == 0  # lengths come from the index, not from the tokens
    for i, doc in enumerate(docs):
        assert as_documents[i].tolist() == doc + [EOS]


def test_a_bad_shard_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="index.json is missing"):
        open_shards(tmp_path)
    write_corpus(tmp_path, documents(10), shard_tokens=64)
    with pytest.raises(ValueError, match="fewer than one context"):
        TokenWindows(tmp_path, 10_000)
    shard = tmp_path / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="shard_00001.bin.*has 126 bytes.*64 tokens"):
        open_shards(tmp_path)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard_00001.bin"):
        open_shards(tmp_path)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    (tmp_path / INDEX_NAME).write_text(json.dumps({**index, "format": "something-else"}))
    with pytest.raises(ValueError, match="not a token-shard index"):
        open_shards(tmp_path)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("garbage, not an index", "is not a token-shard index \\(not JSON"),
        (b"\xff\xfe binary", "is not a token-shard index \\(not JSON"),
        (
            '{"format": "FORMAT", "version": "VERSION", "shards": []}',
            "is not a valid token-shard index \\(KeyError",
        ),
        ('{"format": "FORMAT", "version": "VERSION", "dtype": "<u2", "shards": [{"path": 3}]}', "KeyError"),
        (
            '{"format": "FORMAT", "version": "VERSION", "dtype": "float", "shards": []}',
            "dtype must be an integer",
        ),
    ],
)
def test_a_garbage_index_is_a_config_error_naming_the_file(tmp_path, text, needle):
    from fntrain.config import ConfigError
    from fntrain.data.shard_index import FORMAT, VERSION

    if isinstance(text, str):
        text = text.replace('"FORMAT"', json.dumps(FORMAT)).replace('"VERSION"', json.dumps(VERSION)).encode()
    (tmp_path / INDEX_NAME).write_bytes(text)
    with pytest.raises(ConfigError, match=f"{tmp_path / INDEX_NAME}.*{needle}"):
        open_shards(tmp_path)


# ----------------------------------------------------------------------------- exact resume


def test_cursor_resume_over_a_shard_boundary(tmp_path):
    stream = write_corpus(tmp_path, documents(60), shard_tokens=128)
    context = 16
    shards = open_shards(tmp_path)
    spec = build_data(TokenWindows(shards, context), Batching(2, 2), LoaderConfig(shuffle=False, pin_memory=False))
    full = read_token_rows(batches(spec, 0, 0))
    assert len(full) == steps_per_epoch(spec) >= 10
    # In order, each step covers 4 windows = 64 tokens, so steps 1 -> 2 cross the first shard boundary
    # (token 128), and the resumed step 2 starts exactly on it.
    assert full[2][0][0] == stream[128 : 128 + context].tolist()
    for cursor in range(len(full) + 1):
        before = shards.tokens_read
        assert read_token_rows(batches(spec, 0, cursor)) == full[cursor:]
        # The skipped steps were never read: only the remaining windows were copied out.
        assert shards.tokens_read - before == (len(full) - cursor) * 4 * context

    # Shuffled and sharded over two ranks: every cursor still resumes exactly, and the two ranks'
    # windows are disjoint.
    ranks = [build_data(TokenWindows(tmp_path, context), Batching(2, 2, seed=7, dp_rank=r, dp_size=2))
             for r in range(2)]  # fmt: skip
    epoch = [read_token_rows(batches(rank_spec, 3, 0)) for rank_spec in ranks]
    for rank_spec, rank_full in zip(ranks, epoch, strict=True):
        for cursor in range(len(rank_full) + 1):
            assert read_token_rows(batches(rank_spec, 3, cursor)) == rank_full[cursor:]
    rows = [tuple(row) for rank_full in epoch for step in rank_full for mb in step for row in mb]
    assert len(rows) == len(set(rows))


def test_train_stopped_and_resumed_on_fresh_shards_sees_the_same_batches(tmp_path):
    write_corpus(tmp_path, documents(50), shard_tokens=100)

    def run(state: TrainState, stop_after: int | None) -> tuple[TrainState, list]:
        # A fresh TokenShards each time, as after a restart: nothing carries over but the TrainState.
        spec = build_data(
            TokenWindows(open_shards(tmp_path), 12), Batching(3, 2, seed=5)
        )
        per_epoch = steps_per_epoch(spec)
        plan = RunPlan(train_iters=per_epoch + 4, steps_per_epoch=per_epoch, epochs=2)
        seen = []

        def step_fn(state, batch):
            seen.append([mb["input_ids"].tolist() for mb in batch])
            return {}

        def stopper(event, state, info):
            if stop_after is not None and info is not None and state.global_step == stop_after:
                raise StopTraining

        return train(state, step_fn, [stopper], data=data_fn(spec), plan=plan).state, seen

    _, uninterrupted = run(TrainState(), None)
    stopped, first = run(TrainState(), 3)
    assert stopped.cursor == 3
    middle_state, middle = run(stopped, len(uninterrupted) - 2)  # across the epoch boundary
    assert middle_state.epoch == 1
    _, last = run(middle_state, None)
    assert first + middle + last == uninterrupted


def test_workers_map_the_shards_themselves(tmp_path):
    write_corpus(tmp_path, documents(40), shard_tokens=90)
    shards = open_shards(tmp_path)
    windows = TokenWindows(shards, 20)
    windows[3]  # maps a shard in this process
    copy = pickle.loads(pickle.dumps(windows))  # no mapping or file travels
    assert copy.shards._maps == {} and copy[3]["input_ids"].tolist() == windows[3]["input_ids"].tolist()
    in_process = read_token_rows(batches(build_data(windows, Batching(2, 2, seed=1)), 0, 1))
    with_workers = read_token_rows(
        batches(build_data(windows, Batching(2, 2, seed=1), LoaderConfig(num_workers=2, pin_memory=False)), 0, 1)
    )
    assert with_workers == in_process
    shards.close()
    assert shards._maps == {} and windows[3]["input_ids"].tolist() == copy[3]["input_ids"].tolist()


# ----------------------------------------------------------------------------- memory


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line")


def _walk_epoch(shards: TokenShards, context: int) -> int:
    """RSS growth (bytes) over one in-order epoch of windows read through the pipeline."""
    spec = build_data(TokenWindows(shards, context), Batching(16, 1), LoaderConfig(shuffle=False, pin_memory=False))
    iterator = batches(spec, 0, 0)
    next(iterator)  # warm up: the first mapping and collate allocations
    before = peak = _rss_bytes()
    for count, _ in enumerate(iterator):
        if count % 64 == 0:
            peak = max(peak, _rss_bytes())
    iterator.close()
    return max(peak, _rss_bytes()) - before


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_memory_stays_flat_while_iterating(tmp_path):
    # 24 MiB of uint16 in three shards; a step reads 16 x 2048 tokens = 64 KiB.
    shard_tokens = 4 << 20
    rng = np.random.default_rng(0)
    for number in range(3):
        rng.integers(1, 1000, size=shard_tokens, dtype=np.uint16).tofile(tmp_path / f"shard_{number:05d}.bin")
    infos = tuple(ShardInfo(f"shard_{number:05d}.bin", shard_tokens) for number in range(3))
    write_index(ShardIndex(tmp_path, "<u2", infos, eos_id=EOS, vocab_size=1000))

    flat = _walk_epoch(open_shards(tmp_path, release_bytes=2 << 20), 2048)
    # Without releasing, the same walk keeps every page of the corpus mapped: the measurement is real.
    grown = _walk_epoch(open_shards(tmp_path, release_bytes=None), 2048)
    assert flat < 6 << 20, f"RSS grew by {flat / 2**20:.1f} MiB over a 24 MiB corpus"
    assert grown > 16 << 20, f"without releasing, RSS grew by only {grown / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- phase-1 checks


def test_shard_directories_are_checked_in_one_line_each(tmp_path):
    """[issue 27] hf_causal_lm's data.shards: missing, a file, no index.json, a bad index, ids beyond
    the model's vocabulary (by the index's vocabulary, or by the ids when the index names none)."""
    from fntrain.config import ConfigError

    with pytest.raises(FileNotFoundError, match=r"^data.shards 'nowhere' does not exist$"):
        require_shards("data.shards", "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file"):
        require_shards("data.shards", str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no index.json"):
        require_shards("data.shards", str(tmp_path / "empty"))
    (tmp_path / "empty" / INDEX_NAME).write_text("{")
    with pytest.raises(ConfigError, match=r"^data.shards .*not JSON"):
        require_shards("data.shards", str(tmp_path / "empty"))

    write_corpus(tmp_path / "c", documents(5), shard_tokens=50)  # vocabulary 1000, ids below 1000
    assert require_shards("data.shards", str(tmp_path / "c")).vocab_size == 1000
    check_shard_vocab("data.shards", str(tmp_path / "c"), 1000)
    with pytest.raises(ConfigError, match=r"data.shards .* token ids up to 999 .* vocabulary has 500"):
        check_shard_vocab("data.shards", str(tmp_path / "c"), 500)
    index = json.loads((tmp_path / "c" / INDEX_NAME).read_text())
    index["vocab_size"] = None  # no vocabulary recorded: the ids themselves are read
    (tmp_path / "c" / INDEX_NAME).write_text(json.dumps(index))
    shards = TokenShards(read_index(tmp_path / "c"))
    largest = int(shards.read(0, len(shards)).max())
    shards.close()
    check_shard_vocab("data.shards", str(tmp_path / "c"), largest + 1)
    with pytest.raises(ConfigError, match=f"token ids up to {largest} "):
        check_shard_vocab("data.shards", str(tmp_path / "c"), largest)
