"""`fntrain export`: an fntrain DCP checkpoint as a Hugging Face directory, and an HF directory back as
an fntrain DCP checkpoint.

    fntrain export runs/x/checkpoints --format hf hf_out          # the latest checkpoint (or a step_<N>/)
    fntrain export hf_out --format dcp ckpt_root                  # ckpt_root/step_<N>/ + latest
    export_checkpoint("runs/x/checkpoints/step_200", "hf_out", ExportOptions(format="hf"))

DCP -> HF writes the model weights (the checkpoint's "model.*" tensors, under their model names) as
safetensors: one `model.safetensors`, or above `max_shard_size` `model-0000i-of-0000n.safetensors` files
with a `model.safetensors.index.json` (what `save_pretrained` writes). It works shard by shard: only
one output file's tensors are ever in memory. Beside them:

- `config.json`: for a checkpoint of a Hugging Face model (its run config names `model.path`, a local
  directory with a config.json, or `model_dir` is given) that config, with its dtype set to the
  exported weights' dtype; the model directory's generation config and tokenizer files are copied too,
  and weights tied in that architecture are written once, as `save_pretrained` does, so
  `AutoModelForCausalLM.from_pretrained(out)` loads the result. A checkpoint of a recipe with an
  `hf_conversion` (tiny_gpt: a GPT-2; `fntrain export` finds the recipe the checkpoint's meta.json
  records, or `--recipe`) is written as that conversion says: the same config.json and tensors the run's
  own export writes, loadable by `from_pretrained` (the whole model is read at once then, as a
  conversion may fuse tensors), with the tokenizer its `HFConversion.tokenizer` writes (tiny_gpt: its
  bytes, or the tokenizer of its token shards), so `AutoTokenizer`, lm-eval and `fntrain generate` read
  its text as the run did. For any other model (or `--recipe none`) a config.json of fntrain's
  own: `{"model_type": "fntrain", "fntrain_model": <the run config's "model"
  section>, "dtype": ..., "num_parameters": ...}` -- the recipe's own architecture, not a transformers
  one (rebuild tiny_gpt with `TinyGPT(ModelConfig(**config["fntrain_model"]))` and load the weights with
  `load_state_dict`; every state-dict key is written, tied weights as separate copies).
- `fntrain_export.json`: where the weights came from (checkpoint, step, TrainState), the run config and
  the tied names left out, so the way back restores the same state-dict keys.

HF -> DCP (`fntrain.checkpoint.hf_import`) writes an HF directory back as a complete fntrain
checkpoint, model weights only. The options and the dispatch of `fntrain export` are in
`fntrain.checkpoint.export_options`.

Both directions are offline tools for one process (no torchrun); the output must not exist yet (or be
empty) unless `overwrite` is set. DCP -> HF verifies the checkpoint against its manifest first (a
damaged one fails with one line naming the file and the reason). Both write into a temporary directory
beside `out`, renamed to `out` at the end (its missing parents made only then): a failed export leaves
the disk as it found it, and an old output stays whole until the new one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fntrain.checkpoint import _dist
from fntrain.checkpoint.export import Conversion, set_usual_mode
from fntrain.checkpoint.hf_load import set_offline
from fntrain.checkpoint.staged_out import check_out, require_source_dir, staged_out

__all__ = ["export_hf", "export_source", "PROVENANCE", "SAFE_WEIGHTS", "SAFE_INDEX"]

log = logging.getLogger("fntrain.checkpoint")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PROVENANCE = "fntrain_export.json"
PROVENANCE_FORMAT = 1
MODEL_PREFIX = "model."
# What a Hugging Face model directory holds besides weights: copied next to the exported weights.
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.index\.json$")


def cast_floating(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` cast to `dtype` when it is floating point and a dtype is given (integers keep theirs)."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tied_aliases(config_dir: Path) -> dict[str, str]:
    """alias -> kept name for the weights the transformers architecture in `config_dir/config.json`
    ties (the kept name is the first in `named_parameters` order, the one `save_pretrained` keeps);
    {} when transformers is missing or does not know the architecture."""
    try:
        set_offline()  # an export never downloads
        from transformers import AutoConfig, AutoModelForCausalLM

        from fntrain.runtime.materialize import build_on_meta

        config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
        model = build_on_meta(lambda: AutoModelForCausalLM.from_config(config))
    except Exception as error:  # noqa: BLE001 - no tie information is a fine answer
        log.info("no tied-weight information from %s: %s", config_dir, error)
        return {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


# ----------------------------------------------------------------------------- DCP -> HF


def _model_tensors(path: Path) -> dict[str, Any]:
    """DCP key -> TensorStorageMetadata of the checkpoint's model tensors, in stored order."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from fntrain.checkpoint.safe_reader import read_dcp_metadata

    metadata = read_dcp_metadata(path).state_dict_metadata
    return {
        key: entry
        for key, entry in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }


def _hf_source(run_config: Mapping[str, Any], model_dir: str | None) -> Path | None:
    """The Hugging Face model directory of the run: `model_dir`, else the run config's model.path."""
    if model_dir is not None:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"export.model_dir {model_dir!r} holds no config.json")
        return path
    model = run_config.get("model") if isinstance(run_config.get("model"), Mapping) else {}
    recorded = model.get("path") if isinstance(model, Mapping) else None
    if not recorded:
        return None
    path = Path(str(recorded)).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the checkpoint's run config names model.path {recorded!r}, which holds no config.json from "
            "here; pass export.model_dir (--model-dir) with the model's directory"
        )
    return path


def _plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Consecutive groups of names of at most `max_bytes` (a larger tensor gets a file of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards if shards[-1] else []


def _load_model_keys(path: Path, entries: Mapping[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of `keys` (DCP keys) read from the checkpoint at `path`, and only those."""
    import torch.distributed.checkpoint as dcp

    from fntrain.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner

    tensors = {key: torch.empty(entries[key].size, dtype=entries[key].properties.dtype) for key in keys}
    with _dist.quiet_single_process():
        dcp.load(
            tensors,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    return tensors


def _copy_model_files(source: Path, out: Path, tokenizer_dir: Path | None) -> None:
    for directory in (source, tokenizer_dir):
        if directory is None or not directory.is_dir():
            continue
        for entry in directory.iterdir():
            if entry.is_file() and not _WEIGHT_FILES.match(entry.name) and not (out / entry.name).exists():
                shutil.copy2(entry, out / entry.name)


def _tensor_nbytes(entry: Any, dtype: torch.dtype | None) -> int:
    """Bytes of one checkpoint tensor once exported (floating-point tensors cast to `dtype` if given)."""
    stored = entry.properties.dtype
    target = dtype if dtype is not None and stored.is_floating_point else stored
    return entry.size.numel() * torch.empty((), dtype=target).element_size()


def _tied_in_checkpoint(source: Path | None, entries: Mapping[str, Any]) -> dict[str, str]:
    """alias -> kept name for the tied weights of `source`'s architecture that the checkpoint holds
    under both names (written once, as `save_pretrained` does); {} for a non-HF model."""
    if source is None:
        return {}
    names = {key[len(MODEL_PREFIX) :] for key in entries}
    return {alias: kept for alias, kept in tied_aliases(source).items() if alias in names and kept in names}


def _write_weight_files(
    out: Path, sizes: list[tuple[str, int]], load: Any, max_shard_size: int
) -> tuple[int, int, int, str | None]:
    """Write the tensors named in `sizes` ((name, exported bytes) pairs) to `out` as one safetensors
    file, or shards of at most `max_shard_size` bytes plus an index; `load(names)` returns one file's
    tensors (name -> tensor, cast), so one file's tensors are in memory at a time. Returns (files,
    tensors, parameters) counts and the weights' dtype name (None when they mix dtypes)."""
    from safetensors.torch import save_file

    shards = _plan_shards(sizes, max_shard_size)
    files = (
        [SAFE_WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    dtypes: set[torch.dtype] = set()
    num_parameters = 0
    for file, shard in zip(files, shards, strict=True):
        tensors = {name: tensor.contiguous() for name, tensor in load(shard).items()}
        for name, tensor in tensors.items():
            weight_map[name] = file
            num_parameters += tensor.numel()
            if tensor.is_floating_point():
                dtypes.add(tensor.dtype)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        set_usual_mode(out / file)  # save_file makes 0600 files; the rest of the export is 0644
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                 "weight_map": dict(sorted(weight_map.items()))}  # fmt: skip
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    weights_dtype = _dtype_name(dtypes.pop()) if len(dtypes) == 1 else None
    return len(files), len(weight_map), num_parameters, weights_dtype


def _checkpoint_loader(
    path: Path, entries: Mapping[str, Any], keys: list[str], dtype: torch.dtype | None
) -> tuple[list[tuple[str, int]], Any]:
    """(sizes, load) of `_write_weight_files` for the checkpoint's model tensors `keys`, read from DCP
    file by file, under their model names."""
    sizes = [(key[len(MODEL_PREFIX) :], _tensor_nbytes(entries[key], dtype)) for key in keys]

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        loaded = _load_model_keys(path, entries, [MODEL_PREFIX + name for name in names])
        return {key[len(MODEL_PREFIX) :]: cast_floating(tensor, dtype) for key, tensor in loaded.items()}

    return sizes, load


def _converted_loader(
    path: Path, entries: Mapping[str, Any], convert: Any, dtype: torch.dtype | None
) -> tuple[dict[str, Any], list[tuple[str, int]], Any]:
    """(config.json's dict, sizes, load) for a recipe's conversion: the whole model is read at once
    (a conversion may fuse or split tensors across names)."""
    loaded = _load_model_keys(path, entries, list(entries))
    config, tensors = convert({key[len(MODEL_PREFIX) :]: tensor for key, tensor in loaded.items()})
    tensors = {name: cast_floating(tensor, dtype) for name, tensor in tensors.items()}
    sizes = [(name, tensor.numel() * tensor.element_size()) for name, tensor in tensors.items()]
    return config, sizes, lambda names: {name: tensors[name] for name in names}


def _write_config(
    out: Path,
    source: Path | None,
    run_config: Mapping[str, Any],
    weights_dtype: str | None,
    num_parameters: int,
) -> None:
    """config.json: the HF model's own (dtype set to the weights'), with its generation config and
    tokenizer files copied; for any other model fntrain's own config (see the module docstring)."""
    if source is not None:
        config = json.loads((source / "config.json").read_text())
        if weights_dtype is not None:
            config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = (
                weights_dtype
            )
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        assets = run_config.get("assets") if isinstance(run_config.get("assets"), Mapping) else {}
        tokenizer = assets.get("tokenizer_path") if isinstance(assets, Mapping) else None
        _copy_model_files(source, out, Path(str(tokenizer)).expanduser() if tokenizer else None)
        return
    model_section = run_config.get("model") if isinstance(run_config.get("model"), Mapping) else None
    config = {
        "model_type": "fntrain",
        "fntrain_model": model_section,
        "dtype": weights_dtype,
        "num_parameters": num_parameters,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    max_shard_size: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    model_dir: str | None = None,
    overwrite: bool = False,
    convert: Conversion | None = None,
    tokenizer: Callable[[Path], None] | None = None,
) -> Path:
    """Write the model weights of the fntrain checkpoint `checkpoint` (a step_<N>/ directory, or a
    checkpoint root: its newest intact checkpoint) to the Hugging Face directory `out` (see the module
    docstring). The checkpoint is verified first (a damaged one is a `CheckpointDamagedError` naming the
    file and the reason), and `out` appears only once complete (written beside it, then renamed).
    `convert` (a recipe's `hf_conversion` bound to its config) turns the model's full state dict into
    a transformers model's config.json and tensors; None: the weights keep their names. `tokenizer`
    writes the converted model's tokenizer files into the directory (a recipe's `HFConversion.tokenizer`)."""
    from fntrain.checkpoint.restorer import read_meta

    out = Path(out).expanduser()
    path = export_source(checkpoint, out, overwrite)
    meta = read_meta(path)
    entries = _model_tensors(path)
    if not entries:
        raise ValueError(f"checkpoint {path} holds no model tensors")
    if convert is not None:
        config, sizes, load = _converted_loader(path, entries, convert, dtype)
        source, tied = None, {}
    else:
        source = _hf_source(meta.get("config") or {}, model_dir)
        tied = _tied_in_checkpoint(source, entries)
        config = None
        kept = [key for key in entries if key[len(MODEL_PREFIX) :] not in tied]
        sizes, load = _checkpoint_loader(path, entries, kept, dtype)
    with staged_out(out, overwrite) as staging:
        written = _write_weight_files(staging, sizes, load, max_shard_size)
        files, tensors, num_parameters, weights_dtype = written
        if config is not None:
            _write_converted_config(staging, config, weights_dtype)
        else:
            _write_config(staging, source, meta.get("config") or {}, weights_dtype, num_parameters)
        if tokenizer is not None:
            tokenizer(staging)
        _write_provenance(staging, path, meta, tied, converted=convert is not None)
    log.info("exported %s to %s (%d file(s), %d tensors)", path, out, files, tensors)
    return out


def export_source(
    checkpoint: str | os.PathLike, out: str | os.PathLike | None = None, overwrite: bool = False
) -> Path:
    """The verified checkpoint directory `checkpoint` names (a step_<N>/, or a root: its newest intact
    one); a `FileNotFoundError` naming it as given when there is none (a run directory says which). An
    occupied `out` (unless `overwrite`) fails first, before the checkpoint is read."""
    from fntrain.checkpoint.restorer import resolve_source

    if out is not None:
        check_out(Path(out).expanduser(), overwrite)
    require_source_dir(checkpoint, "checkpoint")
    if (Path(checkpoint).expanduser() / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"{str(checkpoint)!r} is a run directory; export one of its checkpoints: "
            f"{os.path.join(str(checkpoint), 'checkpoints')} (the latest) or a step_<N>/ in it"
        )
    path = resolve_source(str(checkpoint))
    if path is None:
        raise FileNotFoundError(f"no checkpoint at {str(checkpoint)!r}")
    return path


def _write_converted_config(out: Path, config: Mapping[str, Any], weights_dtype: str | None) -> None:
    config = dict(config)
    if weights_dtype is not None:
        config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = weights_dtype
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_provenance(out: Path, path: Path, meta: Mapping[str, Any], tied: Mapping[str, str], *,
                      converted: bool) -> None:  # fmt: skip
    provenance = {
        "format": PROVENANCE_FORMAT,
        "source": str(path),
        "step": meta.get("step"),
        "train_state": meta.get("train_state"),
        "run_config": meta.get("config") or None,
        "recipe": meta.get("recipe"),
        "converted": converted,
        "tied": tied,
        "exported_at": time.time(),
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
