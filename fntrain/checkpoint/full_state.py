"""The model weights of an fntrain checkpoint as full tensors on one process, whatever wrote it.

    state = checkpoint_model_state("runs/x/checkpoints/step_200")   # {"tok.weight": tensor, ...}
    model.load_state_dict(state)

DCP stores every tensor's global shape in its metadata, so a checkpoint saved sharded by FSDP2, TP, PP or
EP at any world size reads back into whole tensors without a process group (the path `fntrain export
--format hf` takes, `fntrain.checkpoint.hf_export`). Only the "model.*" tensors are read; names come
back without that prefix. The caller verifies the checkpoint first (`fntrain.checkpoint.restorer.
resolve_source`); nothing here executes checkpoint code (`fntrain.checkpoint.safe_reader`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fntrain.checkpoint import _dist

__all__ = ["checkpoint_model_state", "MODEL_PREFIX"]

MODEL_PREFIX = "model."


def checkpoint_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """name -> full CPU tensor of every model tensor the checkpoint directory `path` holds (in its
    stored dtype); a `ValueError` when it holds none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fntrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata

    metadata = read_dcp_metadata(path).state_dict_metadata
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not tensors:
        raise ValueError(f"checkpoint {str(path)!r} holds no model tensors")
    with _dist.quiet_single_process():
        dcp.load(
            tensors,
            storage_reader=SafeFileSystemReader(Path(path)),
            planner=SafeLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    return {key[len(MODEL_PREFIX) :]: tensor for key, tensor in tensors.items()}
