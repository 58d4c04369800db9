"""`export_safetensors`: the model's full weights as one safetensors file, for inference and sharing.

Under FSDP2 the full tensors are gathered (a collective: every rank calls this) and only rank 0 writes.
Keys are the model's own FQNs (no DDP/FSDP prefixes); every key of `model.state_dict()` is written, tied
weights included (as separate copies), so `model.load_state_dict(safetensors.torch.load_file(path))`
works as is. The file appears atomically (write to a temp file + os.replace).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fntrain.checkpoint import _dist

__all__ = ["export_safetensors", "export_converted", "full_model_state", "set_usual_mode"]

# (config.json's dict, tensors under their new names) of a model's full state dict: a recipe's
# `hf_conversion` bound to its config.
Conversion = Callable[[Mapping[str, torch.Tensor]], tuple[dict[str, Any], dict[str, torch.Tensor]]]


def full_model_state(model: torch.nn.Module, pipeline_group: Any = None) -> dict[str, torch.Tensor]:
    """`model`'s full (unsharded) state dict on CPU at rank 0 (others may get an empty or partial one);
    a collective: every rank calls it. Under pipeline parallelism (`pipeline_group`: this rank's group of
    stages) each stage holds part of the model: the parts are gathered and merged (names never collide,
    tied copies are equal)."""
    if pipeline_group is None:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    import torch.distributed as dist

    # Without cpu_offload every rank gets the full tensors of its stage (cpu_offload keeps them on
    # global rank 0 only, which holds the first stage alone).
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {key: tensor.detach().cpu() for key, tensor in state.items()}
    leader = dist.get_rank(pipeline_group) == 0
    parts: list[Any] | None = [None] * dist.get_world_size(pipeline_group) if leader else None
    dist.gather_object(state, parts, group=pipeline_group, group_dst=0)
    merged: dict[str, torch.Tensor] = {}
    for part in parts or [state]:
        merged.update(part)
    return merged


def export_safetensors(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    pipeline_group: Any = None,
) -> Path | None:
    """Write `model`'s weights to `path` (rank 0); return the path on rank 0, None elsewhere.

    `metadata` (JSON-able) is stored in the file's string header under "fntrain"; `pipeline_group` as for
    `full_model_state`.
    """
    from safetensors.torch import save_file

    state = full_model_state(model, pipeline_group)
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


def export_converted(
    model: torch.nn.Module, out_dir: str | os.PathLike, convert: Conversion, *, pipeline_group: Any = None
) -> Path:
    """Write `model` converted by `convert` to `out_dir`: model.safetensors and config.json (modes 0666
    less the umask), the files `fntrain export --format hf` writes for the same conversion. A collective
    under a process group (the full weights are gathered as for `full_model_state`); rank 0 writes.
    Returns `out_dir`."""
    from safetensors.torch import save_file

    full = full_model_state(model, pipeline_group)
    out = Path(out_dir).expanduser()
    if _dist.rank() != 0:
        return out
    config, tensors = convert(full)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    tmp = weights.with_name(f".{weights.name}.tmp-{os.getpid()}")
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, str(tmp), metadata={"format": "pt"})
    set_usual_mode(tmp)
    os.replace(tmp, weights)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


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
