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
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return save(SaveTarget(root, toy.components()), TrainState(0, 1, 1))


@pytest.fixture
def legacy(saved, tmp_path):
    """A copy of the saved checkpoint without its manifest (saved by an older fntrain)."""
    import shutil

    path = tmp_path / saved.name
    shutil.copytree(saved, path)
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


def test_manifest_checks_name_file_and_numbers(saved, tmp_path):
    import shutil

    path = tmp_path / saved.name
    shutil.copytree(saved, path)
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
