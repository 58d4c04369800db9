"""A DCP reader that executes no code from the checkpoint.

DCP stores its `.metadata` with plain `pickle` and loads non-tensor entries with
`torch.load(weights_only=False)`; either would run whatever a crafted checkpoint asks. fntrain stores only
tensors in DCP (plain values go to JSON), reads the metadata with an unpickler that resolves only DCP's own
metadata classes, and loads any byte entry with `weights_only=True`.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "read_dcp_metadata"]

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes, torch dtypes/Size/layouts and paths; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA_MODULE and not name.startswith("__"):
            import torch.distributed.checkpoint.metadata as metadata

            value = getattr(metadata, name, None)
            if isinstance(value, type):
                return value
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a DCP metadata type; refusing to load it"
        )


def read_dcp_metadata(path: str | pathlib.Path) -> Metadata:
    """DCP's `.metadata` of the checkpoint at `path`, read without executing checkpoint code."""
    with open(pathlib.Path(path) / ".metadata", "rb") as handle:
        metadata = _MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(
            f"{path}/.metadata does not hold DCP Metadata (got {type(metadata).__name__})"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP Metadata (got {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads byte (non-tensor) entries with `weights_only=True`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
