"""`fntrain export`'s options (`ExportOptions`, sizes such as "5GB") and the one call that converts a
checkpoint as they say (`export_checkpoint`): DCP -> HF in `fntrain.checkpoint.hf_export`, HF -> DCP in
`fntrain.checkpoint.hf_import`."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from fntrain.checkpoint.export import Conversion
from fntrain.checkpoint.hf_export import export_hf
from fntrain.checkpoint.hf_import import import_hf
from fntrain.checkpoint.staged_out import unwritten
from fntrain.config import require_bool, require_choice, require_int, require_str

__all__ = ["ExportOptions", "export_checkpoint", "parse_size", "DTYPES"]

DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


@dataclass(frozen=True)
class ExportOptions:
    """How `fntrain export` converts."""

    format: Literal["hf", "dcp"] = "hf"
    """hf: an fntrain DCP checkpoint -> a Hugging Face directory; dcp: a Hugging Face directory -> an fntrain checkpoint root (step_<N>/ + latest)."""
    max_shard_size: str = "5GB"
    """hf: the largest safetensors file (5GB, 500MB, 2GiB, or bytes); larger models are split into model-0000i-of-0000n.safetensors files with a model.safetensors.index.json."""
    dtype: Literal["keep", "float32", "bfloat16", "float16"] = "keep"
    """Cast floating-point weights to this dtype (keep: as stored)."""
    model_dir: str | None = None
    """hf: the Hugging Face model directory whose config.json, generation config and tokenizer files go with the weights (None: the run config's model.path, when it is one)."""
    recipe: str | None = None
    """hf: the recipe whose conversion to a transformers model applies (tiny_gpt: GPT-2); None: the one the checkpoint records; none: the model's own names and an fntrain config.json."""
    step: int | None = None
    """dcp: the step number of the written checkpoint (None: the exported checkpoint's, else 0)."""
    overwrite: bool = False
    """Replace an existing, non-empty output directory."""

    def validate(self, prefix: str = "export") -> None:
        require_choice(f"{prefix}.format", self.format, ("hf", "dcp"))
        require_str(f"{prefix}.max_shard_size", self.max_shard_size, non_empty=True)
        if parse_size(self.max_shard_size, f"{prefix}.max_shard_size") < 1:
            raise ValueError(f"{prefix}.max_shard_size must be at least 1 byte, got {self.max_shard_size!r}")
        require_choice(f"{prefix}.dtype", self.dtype, tuple(DTYPES))
        require_str(f"{prefix}.model_dir", self.model_dir, optional=True)
        require_str(f"{prefix}.recipe", self.recipe, optional=True, non_empty=True)
        if self.step is not None:
            require_int(f"{prefix}.step", self.step, min=0)
        require_bool(f"{prefix}.overwrite", self.overwrite)


def parse_size(text: str | int, field: str = "export.max_shard_size") -> int:
    """Bytes in "5GB" (decimal units, as Hugging Face counts), "2GiB" (binary), "500MB" or "1024"."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{field} must be a size such as 5GB, 500MB, 2GiB or a byte count, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "B").upper()])


def export_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    options: ExportOptions,
    convert: Conversion | None = None,
    tokenizer: Callable[[Path], None] | None = None,
) -> Path:
    """Convert `source` to `out` as `options.format` says (`convert`, `tokenizer`: as for `export_hf`); return the
    written directory. `out` appears only once complete; an OS error while writing (a full disk) says
    what is left: the previous `out` (with `overwrite`) or nothing."""
    options.validate("export")
    try:
        if options.format == "hf":
            return export_hf(
                source,
                out,
                max_shard_size=parse_size(options.max_shard_size),
                dtype=DTYPES[options.dtype],
                model_dir=options.model_dir,
                overwrite=options.overwrite,
                convert=convert,
                tokenizer=tokenizer,
            )
        return import_hf(
            source, out, step=options.step, dtype=DTYPES[options.dtype], overwrite=options.overwrite
        )
    except OSError as error:
        target = unwritten(error)
        if target is None or not error.strerror:
            raise
        kept = f"the previous {str(out)!r} is kept" if target.previous_kept else "nothing was written"
        raise type(error)(error.errno, f"{error.strerror} while writing {str(out)!r}; {kept}") from error
