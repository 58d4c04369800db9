"""`fntrain.checkpoint.verify` reasons the save/restore tests do not reach: a manifest of another
format, a listed file that cannot be stat'ed or read, a file larger than listed, and the checks of a
checkpoint saved before manifests (DCP's metadata and data files, meta.json, the rank files)."""

from __future__ import annotations

import json

import pytest

from fntrain.checkpoint import SaveTarget, save
from fntrain.checkpoint.layout import DCP_METADATA, MANIFEST
from fntrain.checkpoint.verify import damage, verified, verify_collectively
from fntrain.state import TrainState
from tests.checkpoint import toy


@pytest.fixture
def toy_checkpoint(tmp_path):
    return save(SaveTarget(tmp_path / "ckpt", toy.components()), TrainState(0, 1, 1))


def _edit_manifest(path, change) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_of_another_format_is_damage(toy_checkpoint):
    _edit_manifest(toy_checkpoint, lambda manifest: manifest.update(format=99))
    found = damage(toy_checkpoint)
    assert found.file == MANIFEST and found.reason == "unreadable (not a format-1 crc32 manifest)"
    assert verified(toy_checkpoint) is False


def test_listed_files_that_cannot_be_read_or_are_too_long(toy_checkpoint):
    data = sorted(p.name for p in toy_checkpoint.glob("*.distcp"))[0]
    size = (toy_checkpoint / data).stat().st_size
    (toy_checkpoint / data).write_bytes((toy_checkpoint / data).read_bytes() + b"x")
    assert damage(toy_checkpoint).reason == f"{size + 1} bytes, the manifest says {size}"  # not "truncated"
    (toy_checkpoint / data).write_bytes((toy_checkpoint / data).read_bytes()[:-1])
    assert damage(toy_checkpoint) is None and verified(toy_checkpoint) is True

    (toy_checkpoint / "sub").mkdir()
    stat = (toy_checkpoint / "sub").stat().st_size

    def list_odd_files(manifest):
        manifest["files"]["meta.json/inner"] = {"size": 1, "crc32": "0"}  # under a file: not a directory
        manifest["files"]["sub"] = {"size": stat, "crc32": "0"}  # a directory of the listed size

    _edit_manifest(toy_checkpoint, list_odd_files)
    found = damage(toy_checkpoint)
    assert found.file == "meta.json/inner" and found.reason.startswith("unreadable (Not a directory")
    _edit_manifest(toy_checkpoint, lambda manifest: manifest["files"].pop("meta.json/inner"))
    found = damage(toy_checkpoint)
    assert found.file == "sub" and found.reason.startswith("unreadable (Is a directory")
    assert verify_collectively(toy_checkpoint).file == "sub"  # no process group: the same answer


def test_a_checkpoint_without_manifest_is_checked_without_checksums(toy_checkpoint):
    (toy_checkpoint / MANIFEST).unlink()
    assert damage(toy_checkpoint) is None and verified(toy_checkpoint) is None
    (toy_checkpoint / "rank_1.json").write_text("{not json")
    found = damage(toy_checkpoint)
    assert found.file == "rank_1.json" and found.reason.startswith("unreadable (")
    (toy_checkpoint / "rank_1.json").unlink()
    (toy_checkpoint / "meta.json").rename(toy_checkpoint / "meta.json.bak")
    assert (damage(toy_checkpoint).file, damage(toy_checkpoint).reason) == ("meta.json", "missing")
    (toy_checkpoint / "meta.json.bak").rename(toy_checkpoint / "meta.json")
    data = sorted(toy_checkpoint.glob("*.distcp"))[0]
    data.unlink()
    assert (damage(toy_checkpoint).file, damage(toy_checkpoint).reason) == (data.name, "missing")
    (toy_checkpoint / DCP_METADATA).unlink()
    assert (damage(toy_checkpoint).file, damage(toy_checkpoint).reason) == (DCP_METADATA, "missing")
