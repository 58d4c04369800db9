"""Data fingerprints: what each checkpoint records about the data, and a resume refused when the data
changed (a JSONL with rows appended or a typo fixed in the middle of a line, re-tokenized shards, other
mixing weights), like a changed setting, with `checkpoint.allow_changes data` as the way out. Files are
hashed in full up to `FULL_HASH_BYTES`, sampled and timed past it (the threshold made small here); a
fingerprint recorded before full hashes is compared by the facts it holds."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fntrain.config import ConfigError
from fntrain.data import fingerprint
from fntrain.data.fingerprint import (
    EDGE_BYTES,
    data_files,
    data_fingerprint,
    file_fingerprint,
    fingerprint_changes,
    fingerprint_summary,
)
from fntrain.data.mixing import Mixture
from fntrain.data.shards import TokenWindows, split_windows
from fntrain.data.tokenize import TokenizeSettings, tokenize_documents
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.run.config import CheckpointConfig

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class _Data:
    path: str = ""
    val_path: str | None = None
    shards: str | None = None
    text_key: str = "text"  # not a path field: never fingerprinted, even if a file of that name exists


@dataclass(frozen=True)
class _Config:
    data: _Data


def jsonl(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"example {i}"}) + "\n" for i in range(rows)))
    return path


def write_shards(directory: Path, docs: int = 40, seed: int = 0, overwrite: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    texts = [" ".join(map(str, rng.integers(1, 1000, size=int(rng.integers(5, 60))))) for _ in range(docs)]
    tokenize_documents(texts, directory, lambda text: [int(t) for t in text.split()], eos_id=0, vocab_size=1000,
                       settings=TokenizeSettings(shard_tokens=300, overwrite=overwrite))  # fmt: skip
    return directory


def test_a_file_fingerprint_sees_appends_and_any_edit_of_a_file_it_hashes_in_full(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * (EDGE_BYTES // 64))  # 4 x EDGE_BYTES
    before = file_fingerprint(big)
    assert before["size"] == 4 * EDGE_BYTES and len(before["digest"]) == 32 and len(before["full"]) == 32
    assert "samples" not in before and "mtime_ns" not in before
    assert file_fingerprint(big) == before  # unchanged: equal
    with open(big, "ab") as file:
        file.write(b"appended row\n")
    assert file_fingerprint(big)["size"] == before["size"] + 13
    data = bytearray(big.read_bytes()[: 4 * EDGE_BYTES])
    data[10] ^= 1  # an edit in the head, same size
    big.write_bytes(bytes(data))
    assert file_fingerprint(big)["digest"] != before["digest"]
    data[10] ^= 1
    data[2 * EDGE_BYTES] ^= 1  # the middle: the ends' digest is the same, the full hash is not
    big.write_bytes(bytes(data))
    after = file_fingerprint(big)
    assert after["digest"] == before["digest"] and after["full"] != before["full"]


def test_a_same_size_edit_in_the_middle_of_a_jsonl_line_is_named(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", 15000)
    config = _Config(_Data(path=str(path)))
    saved = data_fingerprint(config, list(range(15000)))
    assert fingerprint_changes(saved, data_fingerprint(config, list(range(15000)))) == []
    text = path.read_text()
    middle = text.index('"example 7500"')
    path.write_text(text[:middle] + text[middle:].replace("example 7500", "exbmple 7500", 1))  # a typo, same size
    assert path.stat().st_size > 4 * EDGE_BYTES  # the edit is far from both ends
    changes = fingerprint_changes(saved, data_fingerprint(config, list(range(15000))))
    assert changes == [f"data.path: contents changed (same size, {path.stat().st_size} bytes)"]


def test_a_file_past_the_full_hash_budget_is_sampled_and_timed(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 8 * EDGE_BYTES)
    small, large = tmp_path / "a.bin", tmp_path / "b.bin"
    small.write_bytes(b"s" * (6 * EDGE_BYTES))
    large.write_bytes(bytes(range(256)) * (EDGE_BYTES // 16))  # 16 x EDGE_BYTES: past the budget
    config = _Config(_Data(path=str(small), val_path=str(large)))
    saved = data_fingerprint(config, None)
    assert "full" in saved["files"]["data.path"]
    assert {"samples", "mtime_ns"} <= set(saved["files"]["data.val_path"])
    assert "full" not in saved["files"]["data.val_path"]
    # a second small file does not fit in what the first left of the budget: sampled too
    assert "samples" in file_fingerprint(small, full=False) and "full" in file_fingerprint(large, full=True)

    stat = large.stat()
    data = bytearray(large.read_bytes())
    data[len(data) // 2 + 1] ^= 1  # between two samples, the time put back: not seen (documented)
    large.write_bytes(bytes(data))
    os.utime(large, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint_changes(saved, data_fingerprint(config, None)) == []
    os.utime(large, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # an edit in place changes the time
    changes = fingerprint_changes(saved, data_fingerprint(config, None))
    assert len(changes) == 1 and changes[0].startswith("data.val_path: modified ") and "same size" in changes[0]
    offset = (len(data) - fingerprint.SAMPLE_BYTES) * 3 // (fingerprint.SAMPLES + 1)
    data[offset] ^= 1  # inside a sample, the time put back: the samples differ
    large.write_bytes(bytes(data))
    os.utime(large, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changes = fingerprint_changes(saved, data_fingerprint(config, None))
    assert changes == [f"data.val_path: contents changed (same size, {len(data)} bytes)"]


def test_an_older_fingerprint_is_compared_by_the_facts_it_recorded(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", 15000)
    config = _Config(_Data(path=str(path)))
    now = data_fingerprint(config, list(range(15000)))
    older = {"files": {name: {"size": facts["size"], "digest": facts["digest"]}
                       for name, facts in now["files"].items()}, "dataset": now["dataset"]}  # fmt: skip
    assert fingerprint_changes(older, now) == []  # a checkpoint from before full hashes still resumes
    text = path.read_text()
    path.write_text(text.replace("example 7500", "exbmple 7500", 1))
    assert fingerprint_changes(older, data_fingerprint(config, list(range(15000)))) == []  # its ends only
    jsonl(path, 15001)
    changes = fingerprint_changes(older, data_fingerprint(config, list(range(15001))))
    assert changes[0].startswith("data.path: size ") and changes[1] == "samples 15000 -> 15001"


def test_the_files_are_the_data_sections_path_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("text").write_text("a file named like a non-path field")
    train, val = jsonl(tmp_path / "train.jsonl", 3), jsonl(tmp_path / "val.jsonl", 2)
    directory = write_shards(tmp_path / "shards")
    config = _Config(_Data(path=str(train), val_path=str(val), shards=str(directory)))
    names = list(data_files(config))
    assert names[:2] == ["data.path", "data.val_path"]
    assert "data.shards/index.json" in names and "data.shards/shard_00000.bin" in names
    assert not any(name.startswith("data.text_key") for name in names)
    assert data_files(object()) == {}


def test_appended_jsonl_rows_are_named_with_the_length(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", 3)
    config = _Config(_Data(path=str(path)))
    saved = data_fingerprint(config, list(range(3)))
    assert fingerprint_changes(saved, data_fingerprint(config, list(range(3)))) == []
    jsonl(path, 4)
    changes = fingerprint_changes(saved, data_fingerprint(config, list(range(4))))
    size = path.stat().st_size
    assert changes[0].startswith("data.path: size ") and changes[0].endswith(f" -> {size} bytes")
    assert changes[1] == "samples 3 -> 4"


def test_retokenized_shards_and_mixing_weights_are_named(tmp_path):
    directory = write_shards(tmp_path / "shards")
    config = _Config(_Data(shards=str(directory)))
    windows = TokenWindows(directory, 16)
    train, _ = split_windows(windows, 0.1)
    saved = data_fingerprint(config, Mixture([train, list(range(10))], [0.5, 0.5]))
    assert saved["dataset"]["sources"][0]["of"]["tokens"] == len(windows.shards)
    write_shards(directory, seed=1, overwrite=True)  # re-tokenized: other documents
    again = TokenWindows(directory, 16)
    retrain, _ = split_windows(again, 0.1)
    changes = fingerprint_changes(
        saved, data_fingerprint(config, Mixture([retrain, list(range(10))], [0.7, 0.3]))
    )
    assert any(change.startswith("data.shards/index.json: ") for change in changes), changes
    assert any(change.startswith("data.shards/shard_00000.bin: ") for change in changes), changes
    assert any(change.startswith("weights [0.5, 0.5] -> [0.7, 0.3]") for change in changes), changes
    assert "file" in fingerprint_summary(saved) and fingerprint_summary(None) == "not recorded"


# ----------------------------------------------------------------------------- through a resume


def tiny_fingerprint_config(tmp_path: Path, corpus: Path, **checkpoint):
    from recipes import tiny_gpt

    base = tiny_gpt.Config()
    return dataclasses.replace(
        base, run_dir=str(tmp_path / "run"), log_every=0,
        model=dataclasses.replace(base.model, context=32, n_layer=1, n_head=2, d_model=32),
        data=dataclasses.replace(base.data, path=str(corpus)),
        train=dataclasses.replace(base.train, train_iters=4, global_batch_size=8, micro_batch_size=4),
        evaluate=EvaluateConfig(eval_every=0, at_end=False), progress=ProgressConfig(enabled=False),
        checkpoint=CheckpointConfig(**checkpoint),
    )  # fmt: skip


def test_a_resume_on_changed_data_is_refused_naming_the_file_unless_allowed(tmp_path, caplog):
    from fntrain.run.job import run_job
    from recipes import tiny_gpt

    corpus = tmp_path / "corpus.txt"
    text = (ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()
    corpus.write_bytes(text[:3000])
    config = tiny_fingerprint_config(tmp_path, corpus, save_every=2)
    run_job(
        dataclasses.replace(config, train=dataclasses.replace(config.train, train_iters=2)), tiny_gpt.spec
    )
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["data"]["files"]["data.path"]["size"] == 3000 and meta["data"]["dataset"]["samples"] > 0

    longer = dataclasses.replace(
        config, train=dataclasses.replace(config.train, train_iters=3),
        checkpoint=CheckpointConfig(save_every=2, restore_from="latest", allow_changes=("train.train_iters",)),
    )  # fmt: skip
    edited = bytearray(text[:3000])
    edited[1500] = ord("#") if edited[1500] != ord("#") else ord("%")  # a same-size edit in the middle
    corpus.write_bytes(bytes(edited))
    with pytest.raises(ConfigError, match=r"was saved with other data: data\.path: contents changed \(same size"):
        run_job(longer, tiny_gpt.spec)
    corpus.write_bytes(text[:3600])  # rows appended under the run
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(ConfigError) as caught:
        run_job(longer, tiny_gpt.spec)
    message = str(caught.value)
    assert "was saved with other data: data.path: size 3000 -> 3600 bytes" in message
    assert "samples " in message and "add data to checkpoint.allow_changes" in message
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before  # refused in phase 1

    allowed = dataclasses.replace(longer, checkpoint=dataclasses.replace(
        longer.checkpoint, allow_changes=("train.train_iters", "data")))  # fmt: skip
    caplog.clear()
    with caplog.at_level("WARNING", logger="fntrain.run.launch"):
        assert run_job(allowed, tiny_gpt.spec).state.global_step == 3
    said = [r.getMessage() for r in caplog.records if r.name == "fntrain.run.launch"]
    assert len(said) == 2, said  # each allowed change once, though both launch phases decide it
    assert said[0] == "resuming with train.train_iters changed from 2 to 3 (checkpoint.allow_changes)"
    assert said[1].startswith("resuming with changed data (checkpoint.allow_changes data): data.path: size 3000 -> 3600")
    metadata = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert set(metadata["allowed_changes"]) == {"train.train_iters", "data"}
