"""Behaviours of the data fingerprint that mutation testing found unpinned (mutation/RESULTS.md): the
hashes a checkpoint records are computed the same way by every later version (else every resume of an old
checkpoint is refused), the full-hash budget is spent file by file up to its last byte, which fields and
files of the data section are fingerprinted, the exact phrases and log line a user reads about a change,
and the log summary's words and digest."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

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
from tests.data.test_fingerprint import _Config, _Data

E = EDGE_BYTES


def content(size: int) -> bytes:
    """Bytes with no period, so that a hash of other offsets is another hash."""
    return hashlib.shake_256(b"fntrain").digest(size)


# ----------------------------------------------------------------------------- recorded hashes

# digest and samples of content(size), as this version records them in a checkpoint's meta.json
RECORDED = {
    100: ("16f9915a8c31815221693848786fdbc4", "92864d819b0ebdb0753ac9653f397e85"),
    3 * E // 2: ("96f7906208b021e9c36689ead1b557c3", "7eebee1c4a3438f3b5afa57d1dac9b7c"),
    2 * E: ("c09ef33303ed3e2bcd6bcd125f486262", "9e2de0595a64b0993bdc88535f92d735"),
    2 * E + 1: ("c4b37fc58428ac1990a5b364b1603b8c", "c093a2de9cf2b78d40e449f754c0b2fc"),
    5 * E // 2: ("af45e1514bce949152987e30b2a24f12", "0d09d7099027221773ae22da93a94db6"),
    4 * E: ("c3b97a3bf0a91b630541731db3097fbf", "ae93ce4236b90c6e0260e295845126dc"),
    5 * E + 123: ("f8410c773103fca14788301eae21f6c1", "2ce90c315de281283f8c6ef785133ea7"),
}


@pytest.mark.parametrize("size", sorted(RECORDED))
def test_a_files_recorded_hashes_are_the_same_in_every_version(tmp_path, size):
    path = tmp_path / "data.bin"
    path.write_bytes(content(size))
    digest, samples = RECORDED[size]
    sampled = file_fingerprint(path, full=False)
    assert (sampled["size"], sampled["digest"], sampled["samples"]) == (size, digest, samples)
    hashed = file_fingerprint(path, full=True)
    assert hashed["digest"] == digest
    # `full` is what `b2sum -l 128 FILE` prints: anyone can check a recorded file by hand
    assert hashed["full"] == hashlib.blake2b(content(size), digest_size=16).hexdigest()


@pytest.mark.parametrize(
    ("size", "where"),
    [(3 * E // 2, E + 10), (2 * E, 2 * E - 1), (2 * E + 1, E + 1), (4 * E, 4 * E - 1), (4 * E, 0)],
)
def test_a_size_and_ends_fingerprint_sees_a_small_file_whole_and_a_large_ones_ends(tmp_path, size, where):
    # a checkpoint from before full hashes recorded size and digest only: an edit within EDGE_BYTES of
    # either end, or anywhere in a file of at most twice that, still refuses its resume
    path = tmp_path / "data.bin"
    data = bytearray(content(size))
    path.write_bytes(data)
    older = {"files": {"data.path": {key: file_fingerprint(path)[key] for key in ("size", "digest")}}}
    data[where] ^= 1
    path.write_bytes(data)
    now = {"files": {"data.path": file_fingerprint(path)}}
    assert fingerprint_changes(older, now) == [f"data.path: contents changed (same size, {size} bytes)"]


@pytest.mark.parametrize(("size", "kind"), [(1000, "full"), (1001, "samples")])
def test_a_file_is_hashed_in_full_up_to_the_budget_and_its_last_byte(tmp_path, monkeypatch, size, kind):
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 1000)
    path = tmp_path / "data.bin"
    path.write_bytes(content(size))
    assert kind in file_fingerprint(path)
    assert kind in data_fingerprint(_Config(_Data(path=str(path))), None)["files"]["data.path"]


@pytest.mark.parametrize(
    ("sizes", "kinds"),
    [
        ([600, 600], ["full", "samples"]),  # the second does not fit in what the first left
        ([400, 400, 400], ["full", "full", "samples"]),
        ([2000, 1000], ["samples", "full"]),  # a sampled file spends none of the budget
        ([400, 600], ["full", "full"]),  # the budget to its last byte
    ],
)
def test_the_full_hash_budget_is_spent_by_the_files_hashed_in_full_in_order(
    tmp_path, monkeypatch, sizes, kinds
):
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 1000)
    directory = tmp_path / "shards"
    directory.mkdir()
    for number, size in enumerate(sizes):
        (directory / f"shard_{number}.bin").write_bytes(content(size))
    files = data_fingerprint(_Config(_Data(shards=str(directory))), None)["files"]
    assert list(files) == [f"data.shards/shard_{number}.bin" for number in range(len(sizes))]
    assert [("full" if "full" in found else "samples") for found in files.values()] == kinds
    assert all(("samples" in found) == ("mtime_ns" in found) != ("full" in found) for found in files.values())


# ----------------------------------------------------------------------------- which files


@dataclass(frozen=True)
class _Section:
    seed: int = 0  # a field that is not a path before those that are
    paths: tuple[str, ...] = ()
    eval_files: list = dataclasses.field(default_factory=list)
    shuffle_files: bool = True  # named like a path field, not a path: not a file
    cache_dir: str = ""  # unset: nothing


def test_every_entry_of_a_list_field_is_a_file_named_with_its_index(tmp_path):
    a, b, c = (tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl"))
    for path in (a, b, c):
        path.write_text("{}\n")
    config = _Config(_Section(paths=(str(a), str(b)), eval_files=[str(c)]))
    assert data_files(config) == {"data.paths[0]": a, "data.paths[1]": b, "data.eval_files[0]": c}


def test_a_directorys_files_are_fingerprinted_its_hidden_files_and_subdirectories_aside(tmp_path):
    directory = tmp_path / "shards"
    for name in ("a.bin", "sub/b.bin", ".lock", ".cache/c.bin", "sub/.partial"):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(b"x")
    assert list(data_files(_Config(_Data(shards=str(directory))))) == [
        "data.shards/a.bin",
        "data.shards/sub/b.bin",
    ]


@pytest.mark.parametrize("section", [{"path": "train.jsonl"}, "train.jsonl", None])
def test_a_data_section_that_is_not_a_dataclass_names_no_files(tmp_path, monkeypatch, section):
    monkeypatch.chdir(tmp_path)
    Path("train.jsonl").write_text("{}\n")
    assert data_files(_Config(section)) == {}


# ----------------------------------------------------------------------------- dataset facts


class _Listed(list):
    shards = ["shard_0.bin", "shard_1.bin"]  # a plain list (its `index` a method): no token count


def test_a_dataset_whose_shards_are_a_plain_list_is_fingerprinted_by_its_length():
    assert data_fingerprint(object(), _Listed(range(5)))["dataset"] == {"samples": 5}


def test_mixing_weights_are_recorded_normalized_to_12_decimals():
    for weights in ([1, 2], [0.1, 0.2]):  # float noise of normalizing aside: the same record
        found = data_fingerprint(object(), Mixture([list(range(3)), list(range(3))], weights))["dataset"]
        assert found["weights"] == [0.333333333333, 0.666666666667]


def test_a_changed_source_of_a_mixture_is_named_by_its_index():
    saved = data_fingerprint(object(), Mixture([list(range(10)), list(range(10))], [1, 1]))
    now = data_fingerprint(object(), Mixture([list(range(10)), list(range(12))], [1, 1]))
    assert fingerprint_changes(saved, now) == ["samples 20 -> 22", "sources[1].samples 10 -> 12"]


@pytest.mark.parametrize(
    ("old", "new", "changes"),
    [
        ({"samples": 3}, {"samples": 3, "tokens": 900}, ["tokens None -> 900"]),
        ({"samples": 3, "tokens": 900}, {"samples": 3}, ["tokens 900 -> None"]),
        ({}, {"samples": 3}, ["samples None -> 3"]),
    ],
)
def test_a_fact_recorded_on_one_side_only_is_named(old, new, changes):
    assert fingerprint_changes({"dataset": old}, {"dataset": new}) == changes


# ----------------------------------------------------------------------------- what a user reads

FILE = {"size": 10, "digest": "d" * 32, "full": "f" * 32}


def test_a_new_and_a_vanished_file_are_named_in_order():
    saved = {"files": {"data.path": FILE, "data.shards/a.bin": FILE}}
    now = {"files": {"data.path": FILE, "data.shards/b.bin": FILE}}
    assert fingerprint_changes(saved, now) == [
        "data.shards/a.bin: no longer there",
        "data.shards/b.bin: new file",
    ]


SAMPLED = {"size": 10, "digest": "d" * 32, "samples": "s" * 32}


@pytest.mark.parametrize(
    ("old_time", "new_time", "change"),
    [
        (10**18, 10**18 + 86400 * 10**9, "modified 2001-09-10 01:46:40 UTC (was 2001-09-09 01:46:40 UTC)"),
        (1.5e18, 10**18, "modified 2001-09-09 01:46:40 UTC (was 1.5e+18)"),  # not ns: shown as recorded
    ],
)
def test_a_large_files_new_time_is_named_in_utc(old_time, new_time, change):
    saved = {"files": {"data.path": {**SAMPLED, "mtime_ns": old_time}}}
    now = {"files": {"data.path": {**SAMPLED, "mtime_ns": new_time}}}
    assert fingerprint_changes(saved, now) == [
        f"data.path: {change}, same size; a file this large is compared by samples and its time"
    ]


OLDER_LINE = (
    "data.path: the checkpoint's fingerprint holds its size and ends only (recorded before full hashes): "
    "compared by those"
)


@pytest.mark.parametrize(
    ("old", "lines"),
    [
        ({"size": 10, "digest": "d" * 32}, [OLDER_LINE]),
        (FILE, []),
        ({**SAMPLED, "mtime_ns": 10**18}, []),
    ],
)
def test_only_a_size_and_ends_fingerprint_is_logged_as_compared_by_those(caplog, old, lines):
    now = {"files": {"data.path": FILE}}  # same size and ends
    with caplog.at_level(logging.INFO, logger="fntrain.data"):
        assert fingerprint_changes({"files": {"data.path": old}}, now) == []
    assert [r.getMessage() for r in caplog.records if r.name == "fntrain.data"] == lines


def test_a_summary_names_files_and_samples():
    two = {"files": {"data.path": FILE, "data.val_path": FILE}, "dataset": {"samples": 4096}}
    one = {"files": {"data.path": FILE}, "dataset": {}}
    none = {"files": None, "dataset": {"samples": 3}}
    pattern = r"{} \(digest [0-9a-f]{{8}}\)"
    assert re.fullmatch(pattern.format("2 files, 4,096 samples"), fingerprint_summary(two))
    assert re.fullmatch(pattern.format("1 file"), fingerprint_summary(one))
    assert re.fullmatch(pattern.format("0 files, 3 samples"), fingerprint_summary(none))


def test_a_summarys_digest_is_the_same_for_the_same_data_and_differs_for_other_data():
    saved = {"files": {"data.path": FILE, "data.val_path": SAMPLED}, "dataset": {"samples": 8, "tokens": 90}}
    reordered = {
        "dataset": {"tokens": 90, "samples": 8},
        "files": {"data.val_path": SAMPLED, "data.path": FILE},
    }
    other = {**saved, "dataset": {"samples": 9, "tokens": 90}}

    def digest(found):
        return fingerprint_summary(found).rsplit(" ", 1)[1]

    assert digest(saved) == digest(reordered) != digest(other)
