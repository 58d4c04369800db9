"""`fntrain.checkpoint.safe_reader` beyond the refused-code cases: a `.metadata` that unpickles to
something other than DCP's Metadata is refused by both readers, names in DCP's metadata module that
are not types are refused, metadata without storage_meta gets one (with the reader's load id), and
non-tensor entries load with `weights_only=True` into flattened and flat state dicts."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fntrain.checkpoint._dist import quiet_single_process
from fntrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata


def _metadata_file(directory, payload: bytes):
    directory.mkdir(exist_ok=True)
    (directory / ".metadata").write_bytes(payload)
    return directory


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    path = _metadata_file(tmp_path / "size", pickle.dumps(torch.Size([2, 3])))
    with pytest.raises(pickle.UnpicklingError, match=r"\.metadata does not hold DCP Metadata \(got Size\)"):
        read_dcp_metadata(path)
    with pytest.raises(pickle.UnpicklingError, match=r"does not hold DCP Metadata \(got Size\)"):
        SafeFileSystemReader(path).read_metadata()


def test_non_type_names_of_the_metadata_module_are_refused(tmp_path):
    payload = b"ctorch.distributed.checkpoint.metadata\nfield\n."  # a global that is a function
    path = _metadata_file(tmp_path / "field", payload)
    with pytest.raises(
        pickle.UnpicklingError, match=r"refers to torch.distributed.checkpoint.metadata.field"
    ):
        read_dcp_metadata(path)


def test_metadata_without_storage_meta_gets_one(tmp_path):
    path = _metadata_file(tmp_path / "bare", pickle.dumps(Metadata(state_dict_metadata={})))
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    assert isinstance(metadata.storage_meta, StorageMeta) and metadata.storage_meta.load_id == reader.load_id


def _planner(flatten: bool) -> SafeLoadPlanner:
    """fntrain's planner (flattened), or a flat one that loads into the very dict it is given (DCP's
    flatten_sharded_tensors would copy it, as torch's own planner does)."""
    if flatten:
        return SafeLoadPlanner()
    return SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


@pytest.mark.parametrize("flatten", [True, False])
def test_byte_entries_load_weights_only(tmp_path, flatten):
    state = (
        {"w": torch.arange(3.0), "extra": {"step": 7, "name": "run"}}
        if flatten
        else {"w": torch.ones(2), "n": 5}
    )
    with quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ck"), no_dist=True)
        target = {
            "w": torch.zeros_like(state["w"]),
            **({"extra": {"step": 0, "name": ""}} if flatten else {"n": 0}),
        }
        dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path / "ck"),
                 planner=_planner(flatten), no_dist=True)  # fmt: skip
    assert torch.equal(target["w"], state["w"])
    assert (target["extra"] if flatten else target["n"]) == (state["extra"] if flatten else state["n"])
