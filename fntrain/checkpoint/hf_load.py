"""Sharded loading of a Hugging Face safetensors directory into a (possibly FSDP2-sharded) model.

    model = build_model(factory, runtime, parallel, fill=hf_weights(model_dir))   # meta -> shard -> load

The files are read through torch.distributed.checkpoint's `HuggingFaceStorageReader`: DCP plans the
load against the model's own state dict, so under FSDP2 each rank reads, from the memory-mapped
safetensors, only the rows of its shards (a DTensor asks for its slice) and never the full model.
Keys follow the model's state-dict names, which for a transformers model are the names
`save_pretrained` writes. A tied parameter the files store once (lm_head tied to the embeddings) is
loaded through the name that is stored; a parameter absent from the files is an error naming it;
buffers absent from the files keep their constructed values (rotary frequencies are not saved).
Values are cast to each parameter's dtype (a bf16 checkpoint loads into fp32 weights).

`set_offline()` turns on the Hugging Face Hub's offline switches; every fntrain path that reaches for
transformers (loading, export) calls it first, so nothing ever tries a download.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_hf_weights", "hf_weights", "hf_checkpoint_keys", "OFFLINE_SWITCHES", "set_offline"]

log = logging.getLogger(__name__)

OFFLINE_SWITCHES = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""The environment that keeps huggingface_hub, transformers and datasets from touching the network."""


def set_offline() -> None:
    """Turn on the Hub's offline switches: nothing in this process may try a download. Call it before
    transformers is imported (it reads some switches once, at import)."""
    os.environ.update(OFFLINE_SWITCHES)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def hf_checkpoint_keys(directory: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """name -> (shape, dtype) of every tensor in the directory's *.safetensors files (headers only)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    return {
        name: (meta.size, meta.properties.dtype)  # type: ignore[union-attr]
        for name, meta in metadata.state_dict_metadata.items()
    }


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's or buffer's names, keyed by every one of its names (tied weights share)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


def load_hf_weights(model: nn.Module, directory: str | Path) -> nn.Module:
    """Fill `model`'s parameters (plain, DDP-wrapped or FSDP2 DTensors) from the safetensors files
    of `directory`, each rank reading only what it holds; every rank must call it. Returns `model`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    directory = Path(directory).expanduser()
    if not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"{str(directory)!r} holds no *.safetensors files")
    stored = hf_checkpoint_keys(directory)
    inner = _unwrap(model)
    state = get_model_state_dict(inner)
    aliases = _aliases(inner)
    param_names = {name for name, _ in inner.named_parameters(remove_duplicate=False)}

    to_load: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, tensor in state.items():
        if name in stored:
            shape = stored[name][0]
            if tuple(shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: the checkpoint in {str(directory)!r} holds shape {tuple(shape)}, "
                    f"the model {tuple(tensor.shape)}"
                )
            to_load[name] = tensor
        elif any(alias in stored for alias in aliases.get(name, ())):
            continue  # tied: loaded through the stored name
        elif name in param_names:
            missing.append(name)
        else:
            log.debug("buffer %s is not in the checkpoint: it keeps its constructed value", name)
    if missing:
        raise KeyError(f"the checkpoint in {str(directory)!r} lacks parameters: {', '.join(sorted(missing))}")
    unexpected = sorted(set(stored) - set(state))
    if unexpected:
        log.warning(
            "the checkpoint in %s holds %d tensors the model does not use: %s%s",
            directory, len(unexpected), ", ".join(unexpected[:8]), ", ..." if len(unexpected) > 8 else "",
        )  # fmt: skip
    import torch.distributed as dist

    single = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # one process without a group is a supported use, not a slip
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(to_load, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=single)
    # DCP wrote into the tensors in place; handing them back lets FSDP2 re-pad its shards.
    set_model_state_dict(inner, to_load, options=StateDictOptions(strict=False))
    return model


def hf_weights(directory: str | Path) -> Callable[[nn.Module], None]:
    """A `fill` for `fntrain.runtime.materialize.build_model` that loads `directory`'s weights."""

    def fill(model: nn.Module) -> None:
        load_hf_weights(model, directory)

    return fill
