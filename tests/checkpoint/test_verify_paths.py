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
def checkpoint(tmp_path):
    return save(SaveTarget(tmp_path / "ckpt", toy.components()), TrainState(0, 1, 1))


def _edit_manifest(path, change) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_of_another_format_is_damage(checkpoint):
    _edit_manifest(checkpoint, lambda manifest: manifest.update(format=99))
    found = damage(checkpoint)
    assert found.file == MANIFEST and found.reason == "unreadable (not a format-1 crc32 manifest)"
    assert verified(checkpoint) is False


def test_listed_files_that_cannot_be_read_or_are_too_long(checkpoint):
    data = sorted(p.name for p in checkpoint.glob("*.distcp"))[0]
    size = (checkpoint / data).stat().st_size
    (checkpoint / data).write_bytes((checkpoint / data).read_bytes() + b"x")
    assert damage(checkpoint).reason == f"{size + 1} bytes, the manifest says {size}"  # not "truncated"
    (checkpoint / data).write_bytes((checkpoint / data).read_bytes()[:-1])
    assert damage(checkpoint) is None and verified(checkpoint) is True

    (checkpoint / "sub").mkdir()
    stat = (checkpoint / "sub").stat().st_size

    def list_odd_files(manifest):
        manifest["files"]["meta.json/inner"] = {"size": 1, "crc32": "0"}  # under a file: not a directory
        manifest["files"]["sub"] = {"size": stat, "crc32": "0"}  # a directory of the listed size

    _edit_manifest(checkpoint, list_odd_files)
    found = damage(checkpoint)
    assert found.file == "meta.json/inner" and found.reason.startswith("unreadable (Not a directory")
    _edit_manifest(checkpoint, lambda manifest: manifest["files"].pop("meta.json/inner"))
    found = damage(checkpoint)
    assert found.file == "sub" and found.reason.startswith("unreadable (Is a directory")
    assert verify_collectively(checkpoint).file == "sub"  # no process group: the same answer


def test_a_checkpoint_without_manifest_is_checked_without_checksums(checkpoint):
    (checkpoint / MANIFEST).unlink()
    assert damage(checkpoint) is None and verified(checkpoint) is None
    (checkpoint / "rank_1.json").write_text("{not json")
    found = damage(checkpoint)
    assert found.file == "rank_1.json" and found.reason.startswith("unreadable (")
    (checkpoint / "rank_1.json").unlink()
    (checkpoint / "meta.json").rename(checkpoint / "meta.json.bak")
    assert (damage(checkpoint).file, damage(checkpoint).reason) == ("meta.json", "missing")
    (checkpoint / "meta.json.bak").rename(checkpoint / "meta.json")
    data = sorted(checkpoint.glob("*.distcp"))[0]
    data.unlink()
    assert (damage(checkpoint).file, damage(checkpoint).reason) == (data.name, "missing")
    (checkpoint / DCP_METADATA).unlink()
    assert (damage(checkpoint).file, damage(checkpoint).reason) == (DCP_METADATA, "missing")
