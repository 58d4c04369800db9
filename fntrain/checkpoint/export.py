"""`export_safetensors`: the model's full weights as one safetensors file, for inference and sharing.

Under FSDP2 the full tensors are gathered (a collective: every rank calls this) and only rank 0 writes.
Keys are the model's own FQNs (no DDP/FSDP prefixes); every key of `model.state_dict()` is written, tied
weights included (as separate copies), so `model.load_state_dict(safetensors.torch.load_file(path))`
works as is. The file appears atomically (write to a temp file + os.replace).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fntrain.checkpoint import _dist

__all__ = ["export_safetensors", "set_usual_mode"]


def export_safetensors(
    model: torch.nn.Module, path: str | os.PathLike, *, metadata: Mapping[str, Any] | None = None
) -> Path | None:
    """Write `model`'s weights to `path` (rank 0); return the path on rank 0, None elsewhere.

    `metadata` (JSON-able) is stored in the file's string header under "fntrain".
    """
    from safetensors.torch import save_file

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if _dist.rank() != 0:
        return None
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        # safetensors refuses tensors sharing memory; tied weights are written as separate copies.
        tensors[key] = (
            tensor.clone().contiguous() if storage in seen or not tensor.is_contiguous() else tensor
        )
        seen.add(storage)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    header = {"format": "pt"}
    if metadata is not None:
        header["fntrain"] = json.dumps(dict(metadata), sort_keys=True)
    save_file(tensors, str(tmp), metadata=header)
    set_usual_mode(tmp)
    os.replace(tmp, path)
    return path


def set_usual_mode(path: str | os.PathLike) -> None:
    """Give a written file the mode `open` would have given it (0666 less the umask: 0644 usually):
    safetensors' `save_file` creates 0600 files, unlike every other file a run writes."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process umask, read without changing it (Linux), else the common 022."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
