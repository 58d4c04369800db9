"""`export_safetensors`: the model's full weights as one safetensors file, for inference and sharing.

Under FSDP2 the full tensors are gathered (a collective: every rank calls this) and only rank 0 writes.
Keys are the model's own FQNs (no DDP/FSDP prefixes); every key of `model.state_dict()` is written, tied
weights included (as separate copies), so `model.load_state_dict(safetensors.torch.load_file(path))`
works as is. The file appears atomically (written as `.<name>.tmp-<pid>` beside it, then renamed): a
failure leaves the previous file, or none. `export_converted` writes a directory the same way
(`fntrain.checkpoint.staged_out.replaced_dir`). A failure of either is `ExportError`'s business once a
run has trained: `export_failure` turns it into the line saying what is kept and what is lost.
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
from fntrain.checkpoint.layout import find_latest, step_of
from fntrain.checkpoint.staged_out import _umask, replaced_dir, replaced_file, unwritten

__all__ = ["export_safetensors", "export_converted", "full_model_state", "set_usual_mode", "ExportError",
           "export_failure"]  # fmt: skip

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
    header = {"format": "pt"}
    if metadata is not None:
        header["fntrain"] = json.dumps(dict(metadata), sort_keys=True)
    with replaced_file(path) as tmp:  # a failure leaves the previous file (or none), no temporary
        save_file(tensors, str(tmp), metadata=header)
    return path


def export_converted(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    convert: Conversion,
    *,
    pipeline_group: Any = None,
    tokenizer: Callable[[Path], None] | None = None,
) -> Path:
    """Write `model` converted by `convert` to `out_dir`: model.safetensors and config.json (modes 0666
    less the umask), and the tokenizer files `tokenizer` writes into the directory (None: none), the
    files `fntrain export --format hf` writes for the same conversion. A collective under a process
    group (the full weights are gathered as for `full_model_state`); rank 0 writes. Returns `out_dir`."""
    from safetensors.torch import save_file

    full = full_model_state(model, pipeline_group)
    out = Path(out_dir).expanduser()
    if _dist.rank() != 0:
        return out
    config, tensors = convert(full)
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    with replaced_dir(out) as staging:  # a failure leaves the previous export (or none), never a half one
        save_file(contiguous, str(staging / "model.safetensors"), metadata={"format": "pt"})
        set_usual_mode(staging / "model.safetensors")
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer(staging)
    return out


class ExportError(RuntimeError):
    """A run's export that failed after its training: `line` says which output, what failed, what is
    kept and what is lost; `step` is the run's last step; `__cause__` the original error."""

    def __init__(self, line: str, step: int):
        super().__init__(line)
        self.line, self.step = line, step


def export_failure(error: BaseException, *, step: int, checkpoints: str | os.PathLike,
                   default: str = "the model") -> ExportError:  # fmt: skip
    """The `ExportError` of `error`, which struck a run's export after step `step`: "exporting
    hf_model: OSError: ...; the checkpoints (newest step_6) are kept, the export was not written", or
    with no complete checkpoint under `checkpoints` "...; no checkpoint was saved, so the run's 6 steps
    are lost: set --checkpoint.save-every". The output's name comes from the atomic writer that failed
    (`staged_out.unwritten`), else `default` (a failure before writing: gathering, converting)."""
    target = unwritten(error)
    name = target.path.name if target is not None else default
    previous = target is not None and target.previous_kept
    latest = find_latest(checkpoints)
    if latest is None:
        export = f"the previous {name} is kept" if previous else "the export was not written"
        kept = f"{export}; no checkpoint was saved, so the run's {step} steps are lost: set --checkpoint.save-every"
    else:
        newest = step_of(latest) or 0
        after = f", {step - newest} steps before the run's end" if newest < step else ""
        checkpoints_kept = f"the checkpoints (newest {latest.name}{after})"
        kept = (
            f"{checkpoints_kept} and the previous {name} are kept"
            if previous
            else f"{checkpoints_kept} are kept, the export was not written"
        )
    return ExportError(f"exporting {name}: {_what(error)}; {kept}", step)


def _what(error: BaseException) -> str:
    """The error in a few words; an OS error about a file of the removed temporary directory without
    that file's name (the export's name says where)."""
    if isinstance(error, OSError) and error.strerror and ".tmp-" in str(error.filename or ""):
        return f"{type(error).__name__}: {error.strerror}"
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def set_usual_mode(path: str | os.PathLike) -> None:
    """Give a written file the mode `open` would have given it (0666 less the umask: 0644 usually):
    safetensors' `save_file` creates 0600 files, unlike every other file a run writes."""
    os.chmod(path, 0o666 & ~_umask())
