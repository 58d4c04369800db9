"""`fntrain export --format dcp`: a Hugging Face directory back as an fntrain DCP checkpoint.

HF -> DCP reads the safetensors memory-mapped (nothing is copied into memory up front) and writes a
complete fntrain checkpoint `<out>/step_<N>/` (DCP data, meta.json, the completion marker) and the
`latest` pointer; N is `step`, else the exported checkpoint's step, else 0. It holds model weights only:
restore it with `checkpoint.weights_only` (a full restore warns that optimizer, schedulers and RNG
start fresh); a converted export is refused (its names are the transformers model's, not the recipe's).
Tied names the HF directory leaves out (fntrain_export.json, or the transformers
architecture of its config.json) are written under each name, as fntrain's own checkpoints hold them.

An offline tool for one process (no torchrun); the output must not exist yet (or be empty) unless
`overwrite` is set, and it is written beside `out` and renamed at the end (`fntrain.checkpoint.staged_out`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch

from fntrain.checkpoint import _dist
from fntrain.checkpoint.hf_export import (
    MODEL_PREFIX,
    PROVENANCE,
    PROVENANCE_FORMAT,
    cast_floating,
    tied_aliases,
)
from fntrain.checkpoint.layout import step_dir, step_of, write_json_atomic, write_latest, write_marker
from fntrain.checkpoint.staged_out import check_out, require_source_dir, staged_out
from fntrain.checkpoint.verify import write_manifest

__all__ = ["import_hf"]

log = logging.getLogger("fntrain.checkpoint")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return header, 8 + length


def _mapped_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of a private memory map: pages are read when
    DCP writes them, never all at once."""
    header, data_start = _read_header(file)
    storage = torch.UntypedStorage.from_file(str(file), False, file.stat().st_size)
    tensors: dict[str, torch.Tensor] = {}
    unaligned: list[str] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which fntrain does not read")
        offset = data_start + info["data_offsets"][0]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            unaligned.append(name)
            continue
        tensors[name] = torch.empty(0, dtype=dtype).set_(storage, offset // itemsize, tuple(info["shape"]))
    if unaligned:  # an old writer's unpadded header: copy these few instead of mapping them
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            for name in unaligned:
                tensors[name] = handle.get_tensor(name)
    return tensors


def _read_provenance(directory: Path) -> dict[str, Any]:
    file = directory / PROVENANCE
    if not file.is_file():
        return {}
    provenance = json.loads(file.read_text())
    if provenance.get("format") != PROVENANCE_FORMAT:
        raise ValueError(
            f"{file} has format {provenance.get('format')!r}; this fntrain reads {PROVENANCE_FORMAT}"
        )
    return provenance


def import_hf(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the safetensors weights of the Hugging Face directory `hf_dir` as a complete fntrain
    checkpoint under the checkpoint root `out`; return its step directory (see the module docstring)."""
    out = Path(out).expanduser()
    check_out(out, overwrite)  # an occupied output fails before anything is read
    require_source_dir(hf_dir, "Hugging Face directory")
    hf_dir = Path(hf_dir).expanduser()
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        if (hf_dir / ".metadata").is_file() or step_of(hf_dir) is not None:
            raise ValueError(
                f"{str(hf_dir)!r} is an fntrain checkpoint: --format dcp reads a Hugging Face directory"
            )
        raise FileNotFoundError(f"{str(hf_dir)!r} holds no *.safetensors files")
    provenance = _read_provenance(hf_dir)
    if provenance.get("converted"):
        raise ValueError(
            f"{str(hf_dir)!r} holds a model converted by its recipe ({provenance.get('recipe')}); "
            "--format dcp reads an export under the model's own names: "
            "fntrain export CKPT --format hf OUT --recipe none"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in _mapped_tensors(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in more than one file of {hf_dir}")
            tensors[name] = tensor
    tied = provenance.get("tied") if provenance else None
    if tied is None and (hf_dir / "config.json").is_file():
        tied = tied_aliases(hf_dir)
    for alias, kept in (tied or {}).items():
        if alias not in tensors and kept in tensors:
            tensors[alias] = tensors[kept]  # fntrain checkpoints hold a tied weight under each name

    if step is None:
        saved = provenance.get("step")
        step = saved if isinstance(saved, int) and saved >= 0 else 0
    with staged_out(out, overwrite) as staging:
        _write_dcp_dir(staging, hf_dir, tensors, provenance, step, dtype)
    log.info("imported %s as %s (%d tensors)", hf_dir, step_dir(out, step), len(tensors))
    return step_dir(out, step)


def _write_dcp_dir(
    root: Path, hf_dir: Path, tensors: dict[str, torch.Tensor], provenance: dict[str, Any], step: int,
    dtype: torch.dtype | None,
) -> None:  # fmt: skip
    """The complete checkpoint `<root>/step_<step>/` of `tensors` and the `latest` pointer to it."""
    import torch.distributed.checkpoint as dcp

    from fntrain.checkpoint.saver import FORMAT_VERSION

    path = step_dir(root, step)
    path.mkdir()
    state = {MODEL_PREFIX + name: cast_floating(tensor, dtype) for name, tensor in tensors.items()}
    train_state = provenance.get("train_state") or {"epoch": 0, "global_step": step, "cursor": 0}
    write_json_atomic(
        path / "meta.json",
        {
            "format": FORMAT_VERSION,
            "step": step,
            "train_state": train_state,
            "world_size": 1,
            "values": [],
            "config": provenance.get("run_config"),
            "torch_version": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "saved_at": time.time(),
            "imported_from": str(hf_dir),
        },
    )
    with _dist.quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)
    write_manifest(path)
    write_marker(path, {"step": step, "train_state": train_state, "completed_at": time.time()})
    write_latest(root, path)
