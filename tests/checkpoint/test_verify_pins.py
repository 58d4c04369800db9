"""Behaviours of checkpoint verification that mutation testing found unpinned (mutation/RESULTS.md):
what `damage` says about a checkpoint saved before manifests existed (DCP's metadata missing or
unreadable, a data file shorter than the metadata needs, a JSON file that does not parse), and the
manifest's own checks (sizes, checksums, required files)."""

from __future__ import annotations

import json
import os

import pytest

from fntrain.checkpoint import SaveTarget, save
from fntrain.checkpoint.layout import DCP_METADATA, MANIFEST
from fntrain.checkpoint.verify import Damage, checksum, damage, read_manifest, verified
from fntrain.state import TrainState
from tests.checkpoint import toy

DATA = "__0_0.distcp"


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return save(SaveTarget(root, toy.components()), TrainState(0, 1, 1))


@pytest.fixture
def legacy(saved_checkpoint, tmp_path):
    """A copy of the saved checkpoint without its manifest (saved by an older fntrain)."""
    import shutil

    path = tmp_path / saved_checkpoint.name
    shutil.copytree(saved_checkpoint, path)
    (path / MANIFEST).unlink()
    return path


def test_a_legacy_checkpoint_that_is_whole_verifies_as_unverifiable(legacy):
    assert damage(legacy) is None
    assert verified(legacy) is None


def test_legacy_missing_metadata_is_named(legacy):
    (legacy / DCP_METADATA).unlink()
    assert damage(legacy) == Damage(legacy, DCP_METADATA, "missing")


def test_legacy_unreadable_metadata_is_named_with_the_error_type(legacy):
    (legacy / DCP_METADATA).write_bytes(b"not a pickle")
    found = damage(legacy)
    assert (found.path, found.file) == (legacy, DCP_METADATA)
    assert found.reason.startswith("unreadable (") and found.reason.endswith(")")
    assert found.reason.split("(", 1)[1].split(":")[0].endswith("Error")  # "(UnpicklingError: ...)"


def test_legacy_truncated_data_names_the_size_dcp_needs(legacy):
    size = os.path.getsize(legacy / DATA)
    with open(legacy / DATA, "r+b") as handle:
        handle.truncate(size - 1)
    assert damage(legacy) == Damage(legacy, DATA, f"truncated: {size - 1} bytes, DCP's metadata needs {size}")


def test_legacy_missing_data_file_is_named(legacy):
    (legacy / DATA).unlink()
    assert damage(legacy) == Damage(legacy, DATA, "missing")


def test_legacy_json_files(legacy):
    (legacy / "meta.json").write_text("{")
    found = damage(legacy)
    assert (found.file, found.reason.startswith("unreadable (")) == ("meta.json", True)
    (legacy / "meta.json").unlink()
    assert damage(legacy) == Damage(legacy, "meta.json", "missing")


def test_manifest_checks_name_file_and_numbers(saved_checkpoint, tmp_path):
    import shutil

    path = tmp_path / saved_checkpoint.name
    shutil.copytree(saved_checkpoint, path)
    size, crc = checksum(path / DATA)
    assert read_manifest(path)["files"][DATA] == {"size": size, "crc32": crc}
    with open(path / DATA, "ab") as handle:
        handle.write(b"x")
    assert damage(path) == Damage(path, DATA, f"{size + 1} bytes, the manifest says {size}")
    assert damage(path, contents=False) == Damage(path, DATA, f"{size + 1} bytes, the manifest says {size}")
    assert str(damage(path)) == f"{path / DATA}: {size + 1} bytes, the manifest says {size}"
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"]["meta.json"]
    manifest["files"][DATA]["size"] = size + 1
    manifest["files"][DATA]["crc32"] = checksum(path / DATA)[1]
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert damage(path) == Damage(path, "meta.json", "not in the manifest")


# ----------------------------------------------------------------------------- checksums and listing


def test_checksum_of_a_file_longer_than_one_read_covers_every_byte_and_warns_nothing(tmp_path):
    import warnings
    import zlib

    data = bytes(range(256)) * (40_000)  # 10 MB: more than one 8 MiB read
    (tmp_path / "big").write_bytes(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checksum(tmp_path / "big") == (len(data), f"{zlib.crc32(data):08x}")
    assert caught == []


def test_a_manifest_lists_the_regular_files_only(tmp_path):
    from fntrain.checkpoint.layout import MARKER
    from fntrain.checkpoint.verify import build_manifest

    names = {f"file_{index:02d}.bin" for index in range(20)}
    for name in names:
        (tmp_path / name).write_text(name)
    for skipped in (MANIFEST, MARKER, ".meta.json.tmp-123", "z.tmp-9"):
        (tmp_path / skipped).write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "a_sub").mkdir()
    assert set(build_manifest(tmp_path)["files"]) == names


def test_several_files_are_summed_in_named_checksum_threads(tmp_path, monkeypatch):
    import threading

    from fntrain.checkpoint import verify
    from fntrain.checkpoint.verify import build_manifest

    threads: list[str] = []
    original = verify.checksum

    def recording(file):
        threads.append(threading.current_thread().name)
        return original(file)

    monkeypatch.setattr(verify, "checksum", recording)
    for name in ("a", "b"):
        (tmp_path / name).write_text(name)
    assert set(build_manifest(tmp_path)["files"]) == {"a", "b"}
    assert len(threads) == 2 and all(name.startswith("fntrain-crc") for name in threads), threads


# ----------------------------------------------------------------------------- what damage() names


def _copy(saved, tmp_path, name="copy"):
    import shutil

    path = tmp_path / name / saved.name
    shutil.copytree(saved, path)
    return path


NOT_A_MANIFEST = "unreadable (not a format-1 crc32 manifest)"


def _each_entry(change):
    return lambda manifest: {**manifest, "files": {k: change(v) for k, v in manifest["files"].items()}}


@pytest.mark.parametrize(
    "edit",
    [
        lambda manifest: [],  # not an object
        lambda manifest: {**manifest, "algorithm": "sha256"},
        _each_entry(lambda entry: {"size": entry["size"]}),
        _each_entry(lambda entry: {"crc32": entry["crc32"]}),
        _each_entry(lambda entry: [entry["size"], entry["crc32"]]),
    ],
    ids=["list", "algorithm", "no-crc", "no-size", "entry-not-object"],
)
def test_a_manifest_this_fntrain_does_not_know_is_named_damage(saved_checkpoint, tmp_path, edit):
    path = _copy(saved_checkpoint, tmp_path)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(edit(manifest)))
    assert damage(path) == Damage(path, MANIFEST, NOT_A_MANIFEST)
    assert verified(path) is False


def test_damage_names_the_directory_the_marker_and_the_manifest(saved_checkpoint, tmp_path):
    from fntrain.checkpoint.layout import MARKER

    (tmp_path / "a_file").write_text("x")
    assert damage(tmp_path / "a_file") == Damage(tmp_path / "a_file", "", "not a directory")
    assert damage(tmp_path / "nowhere") == Damage(tmp_path / "nowhere", "", "not a directory")
    path = _copy(saved_checkpoint, tmp_path)
    (path / MARKER).unlink()
    assert damage(path) == Damage(path, MARKER, "missing (an interrupted save?)")
    assert str(damage(path)) == f"{path / MARKER}: missing (an interrupted save?)"
    path = _copy(saved_checkpoint, tmp_path, "unparsable")
    (path / MANIFEST).write_text("{")
    found = damage(path)
    assert (found.path, found.file) == (path, MANIFEST) and found.reason.startswith("unreadable (")


def test_a_listed_file_missing_or_unreadable_is_named_in_its_directory(saved_checkpoint, tmp_path):
    path = _copy(saved_checkpoint, tmp_path)
    (path / DATA).unlink()
    assert damage(path) == Damage(path, DATA, "missing")
    path = _copy(saved_checkpoint, tmp_path, "odd")
    (path / "sub").mkdir()
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["sub"] = {"size": (path / "sub").stat().st_size, "crc32": "0"}  # stat works, read not
    (path / MANIFEST).write_text(json.dumps(manifest))
    found = damage(path)
    assert (found.path, found.file) == (path, "sub") and found.reason.startswith("unreadable (")
    manifest["files"]["meta.json/inner"] = {"size": 1, "crc32": "0"}  # stat fails: not a directory
    (path / MANIFEST).write_text(json.dumps(manifest))
    found = damage(path)
    assert (found.path, found.file) == (path, "meta.json/inner") and found.reason.startswith("unreadable (")


def test_legacy_unreadable_json_is_named_in_its_directory(legacy):
    (legacy / "rank_0.json").write_text("{")
    found = damage(legacy)
    assert (found.path, found.file) == (legacy, "rank_0.json") and found.reason.startswith("unreadable (")


def _metadata_listing(monkeypatch, path, reorder):
    """DCP's metadata of `path` with its storage entries (key, info) passed through `reorder`."""
    from fntrain.checkpoint import safe_reader

    metadata = safe_reader.read_dcp_metadata(path)
    items = reorder(list(metadata.storage_data.items()))
    metadata.storage_data = dict(items)
    monkeypatch.setattr(safe_reader, "read_dcp_metadata", lambda _path: metadata)
    return metadata


@pytest.mark.parametrize("order", [lambda items: items[::-1], lambda items: items[1:] + items[:1]])
def test_legacy_data_needs_its_furthest_tensor_whatever_the_metadata_order(legacy, monkeypatch, order):
    metadata = _metadata_listing(monkeypatch, legacy, order)
    end = max(info.offset + info.length for info in metadata.storage_data.values())
    assert end == os.path.getsize(legacy / DATA)
    with open(legacy / DATA, "r+b") as handle:
        handle.truncate(end - 1)
    assert damage(legacy) == Damage(legacy, DATA, f"truncated: {end - 1} bytes, DCP's metadata needs {end}")


def test_legacy_file_holding_only_empty_tensors_may_be_empty(legacy, monkeypatch):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    (legacy / "__1_0.distcp").write_bytes(b"")

    def plus_an_empty_tensor(items):
        key, info = items[0]
        return [*items, (MetadataIndex("model.nothing"), type(info)("__1_0.distcp", 0, 0))]

    _metadata_listing(monkeypatch, legacy, plus_an_empty_tensor)
    assert damage(legacy) is None


def test_the_damaged_error_is_one_line_naming_file_and_reason(saved_checkpoint):
    from fntrain.checkpoint.verify import CheckpointDamagedError

    found = Damage(saved_checkpoint, DATA, "missing")
    error = CheckpointDamagedError(found)
    assert str(error) == f"damaged checkpoint: {saved_checkpoint / DATA}: missing" and error.damage == found
    assert str(CheckpointDamagedError(found, "; see --resume")).endswith("missing; see --resume")


# ----------------------------------------------------------------------------- the verified cache


@pytest.fixture
def reads(monkeypatch):
    """The names of the files verification reads (checksums), in any thread."""
    import threading

    from fntrain.checkpoint import verify

    names: list[str] = []
    lock = threading.Lock()
    original = verify.checksum

    def counting(file):
        with lock:
            names.append(os.path.basename(file))
        return original(file)

    monkeypatch.setattr(verify, "checksum", counting)
    return names


def test_a_checkpoint_just_written_is_trusted_without_reading_it_again(tmp_path, reads):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    reads.clear()
    assert verified(path) is True and reads == []
    blob = bytearray((path / DATA).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / DATA).write_bytes(bytes(blob))  # same size, new mtime: read again, and found changed
    assert verified(path) is False and DATA in reads


def test_a_checkpoint_once_verified_is_not_read_again(saved_checkpoint, tmp_path, reads):
    path = _copy(saved_checkpoint, tmp_path)
    assert verified(path) is True and len(reads) == 4  # a copy: its files are read once
    reads.clear()
    assert verified(path) is True and reads == []
    path = _copy(saved_checkpoint, tmp_path, "by-damage")
    assert damage(path) is None
    reads.clear()
    assert verified(path) is True and reads == []


# ----------------------------------------------------------------------------- several ranks


GROUP = object()  # a process group of 2 of the 4 ranks: its rank and size differ from the world's


def _ranks(monkeypatch, world):
    """`world` ranks played by threads (tests/checkpoint/test_durability.py), in a process group that is
    not the whole world: asked about another group (the world), they answer the world's rank and size,
    and a gather over another group fails."""
    import torch

    from fntrain.checkpoint import _dist
    from tests.checkpoint.test_durability import FakeRanks

    ranks = FakeRanks(monkeypatch, world)
    gather = ranks.all_gather_object

    def all_gather_object(output, obj, group=None):
        assert group is GROUP, "gathered over another group than the one asked for"
        gather(output, obj, group)

    monkeypatch.setattr(_dist, "rank", lambda group=None: ranks.local.rank + (0 if group is GROUP else world))
    monkeypatch.setattr(_dist, "world_size", lambda group=None: world if group is GROUP else 2 * world)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    return ranks


def _flip(file):
    blob = bytearray(file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    file.write_bytes(bytes(blob))


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_agrees_on_what_damage_names_whichever_rank_found_it(saved_checkpoint, tmp_path, monkeypatch, world):
    """Two damaged files, in every pair: all ranks answer what `damage(path)` answers (the first file in
    the checkpoint's order), even when the rank that found it found it after another rank found its own."""
    import itertools

    from fntrain.checkpoint.verify import verify_collectively

    names = sorted(read_manifest(saved_checkpoint)["files"])
    assert len(names) == 4
    ranks = _ranks(monkeypatch, world)
    for pair in itertools.combinations(names, 2):
        path = _copy(saved_checkpoint, tmp_path, "-".join(name.strip(".") for name in pair))
        for name in pair:
            _flip(path / name)
        expected = damage(path)
        assert expected.file == pair[0] and expected.reason.startswith("changed: crc32")
        assert ranks.run(lambda path=path: verify_collectively(path, GROUP)) == [expected] * world, pair


def test_ranks_agree_on_a_legacy_checkpoint_as_damage_does(legacy, monkeypatch):
    from fntrain.checkpoint.verify import verify_collectively

    (legacy / DATA).unlink()  # found by DCP's metadata check (the first), named as the data file
    (legacy / "meta.json").write_text("{")
    expected = Damage(legacy, DATA, "missing")
    assert damage(legacy) == expected
    ranks = _ranks(monkeypatch, 2)
    assert ranks.run(lambda: verify_collectively(legacy, GROUP)) == [expected, expected]


def test_ranks_check_each_file_once_and_remember_an_intact_checkpoint(saved_checkpoint, tmp_path, monkeypatch, reads):
    import collections

    from fntrain.checkpoint.verify import verify_collectively

    path = _copy(saved_checkpoint, tmp_path)
    ranks = _ranks(monkeypatch, 2)
    assert ranks.run(lambda: verify_collectively(path, GROUP)) == [None, None]
    assert collections.Counter(reads) == {name: 1 for name in read_manifest(path)["files"]}
    reads.clear()
    assert verified(path) is True and reads == []  # remembered as verified


def test_a_size_only_check_never_vouches_for_the_contents(saved_checkpoint, tmp_path):
    """`damage(contents=False)` reads no file, so it must not fill the cache `verified()` trusts: a data
    file rewritten with other bytes of the same size is still found damaged afterwards."""
    path = _copy(saved_checkpoint, tmp_path)
    data = path / DATA
    data.write_bytes(bytes(b ^ 0xFF for b in data.read_bytes()))  # same size, other contents
    assert damage(path, contents=False) is None
    assert verified(path) is False
