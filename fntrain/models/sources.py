"""What a model source names, decided from the files alone (no model is built): the front half of
`fntrain generate`.

    source = resolve_model_source("runs/tiny")     # ModelSource(kind="checkpoint", path=.../step_400, ...)

A source is one of:

- a run directory: its latest verified checkpoint (damaged ones are skipped with a warning), else its
  export `<run_dir>/model.safetensors`, else its `hf_model/` (the recipe's `output_dir`);
- a checkpoint `step_<N>/` (verified: a damaged one is the `CheckpointDamagedError` line), or a
  checkpoint root (its newest intact checkpoint);
- a `model.safetensors` export (the run's config.json beside it says the model's shape);
- a Hugging Face directory (config.json with a `model_type`, as `save_pretrained` writes it): any causal
  LM, a run's `hf_model/`, a LoRA adapter directory, a vision-language model.

A checkpoint records its recipe in meta.json; a run directory without one records the command line that
ran it (`run_metadata.json`), from which `recorded_recipe` reads the recipe's name or file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from fntrain.checkpoint.layout import LATEST, MARKER, checkpoint_root, find_latest, step_of

__all__ = ["ModelSource", "resolve_model_source", "recorded_recipe", "NO_EXPORT"]

NO_EXPORT = (
    "run directory {source!r} has no complete checkpoint and no export: train with "
    "--checkpoint.save-every N, or name a checkpoint"
)
_RUN_FILES = ("run_metadata.json", "metrics.jsonl", "checkpoints")


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are and what describes them.

    kind: "checkpoint" (`path` a verified step_<N>/), "safetensors" (`path` a model.safetensors of the
    model's own names), "hf" (`path` a Hugging Face directory). `run_config` is the run's config as a
    dict (None for an HF directory), `recipe` the recipe reference it records (None: not recorded)."""

    kind: Literal["checkpoint", "safetensors", "hf"]
    path: Path
    run_config: dict[str, Any] | None = None
    recipe: str | None = None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_hf_dir(path: Path) -> bool:
    """A save_pretrained directory: a transformers config.json, or a peft adapter (a LoRA export)."""
    if not path.is_dir():
        return False
    config = _read_json(path / "config.json")
    if config is not None:
        return "model_type" in config and config.get("model_type") != "fntrain"
    return (path / "adapter_config.json").is_file()


def _from_checkpoint(source: str) -> ModelSource:
    """A verified checkpoint (a step_<N>/ or a root's newest intact one) with its meta.json."""
    from fntrain.checkpoint.restorer import read_meta, resolve_source

    path = resolve_source(source)
    if path is None:  # "none" is not a path a user types here, but resolve_source accepts it
        raise FileNotFoundError(f"no checkpoint at {source!r}")
    meta = read_meta(path)
    return ModelSource("checkpoint", path, meta.get("config") or None, meta.get("recipe"))


def _from_export(source: str, file: Path) -> ModelSource:
    """`model.safetensors` beside the run's config.json (a run directory's export), or inside a
    `fntrain export --recipe none` directory (its provenance holds the run config and the recipe)."""
    provenance = _read_json(file.parent / "fntrain_export.json")
    if provenance is not None:
        return ModelSource("safetensors", file, provenance.get("run_config"), provenance.get("recipe"))
    run_config = _read_json(file.parent / "config.json")
    if run_config is None or "model_type" in run_config:
        raise FileNotFoundError(
            f"{source!r}: no run config.json beside {file.name} says the model's shape "
            "(name the run directory, a checkpoint or a Hugging Face directory)"
        )
    return ModelSource("safetensors", file, run_config, recorded_recipe(file.parent))


def _from_run_dir(source: str, path: Path, run_config: dict[str, Any]) -> ModelSource:
    checkpoint = run_config.get("checkpoint") if isinstance(run_config.get("checkpoint"), dict) else {}
    root = checkpoint_root(SimpleNamespace(dir=checkpoint.get("dir")), path)
    if find_latest(root) is not None:
        return _from_checkpoint(str(root))
    if (path / "model.safetensors").is_file():
        return _from_export(source, path / "model.safetensors")
    output_dir = run_config.get("output_dir")  # a relative one lies under the run directory
    for candidate in (path / Path(str(output_dir)).expanduser() if output_dir else None, path / "hf_model"):
        if candidate is not None and _is_hf_dir(candidate):
            return ModelSource("hf", candidate, run_config)
    raise FileNotFoundError(NO_EXPORT.format(source=source))


def resolve_model_source(source: str) -> ModelSource:
    """The `ModelSource` the path `source` names (see the module docstring). A missing path, a
    directory that is none of these, or a run directory with nothing to load is a `FileNotFoundError`
    naming `source` as typed; a damaged checkpoint named by path a `CheckpointDamagedError`; an
    incomplete one a `ConfigError`."""
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{source!r} does not exist")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FileNotFoundError(
                f"{source!r} is a file, not a run directory, a checkpoint or a model directory"
            )
        return _from_export(source, path)
    if _is_hf_dir(path):
        return ModelSource("hf", path)
    if (path / MARKER).is_file() or step_of(path) is not None:
        return _from_checkpoint(source)
    if (path / LATEST).exists() or any(path.glob("step_*")):
        return _from_checkpoint(source)  # a checkpoint root: its newest intact checkpoint
    run_config = _read_json(path / "config.json")
    if run_config is not None and "model_type" not in run_config:
        return _from_run_dir(source, path, run_config)
    if (path / "model.safetensors").is_file() and (path / "fntrain_export.json").is_file():
        return _from_export(source, path / "model.safetensors")
    if any((path / name).exists() for name in _RUN_FILES):
        raise FileNotFoundError(NO_EXPORT.format(source=source))
    raise FileNotFoundError(
        f"{source!r} is not a run directory, a checkpoint or a Hugging Face model directory "
        "(no config.json, no checkpoint)"
    )


def recorded_recipe(run_dir: str | os.PathLike) -> str | None:
    """The recipe the run in `run_dir` was started with: the one its checkpoints' meta.json record,
    else read from the command line in its run_metadata.json: `fntrain run RECIPE ...` (torchrun's `-m fntrain run RECIPE` too), or a recipe
    file run as a script (`python my_gpt.py`, resolved against the run's working directory); None when
    not recorded."""
    run_dir = Path(run_dir).expanduser()
    for meta in sorted(run_dir.glob("checkpoints/step_*/meta.json")):  # a checkpoint records it exactly
        recipe = (_read_json(meta) or {}).get("recipe")
        if isinstance(recipe, str) and recipe:
            return recipe
    metadata = _read_json(run_dir / "run_metadata.json") or {}
    command = metadata.get("command") if isinstance(metadata.get("command"), dict) else {}
    argv = [str(arg) for arg in command.get("argv") or []]
    if len(argv) > 2 and argv[1] == "run" and not argv[2].startswith("-"):
        recipe = argv[2]
    elif argv and argv[0].endswith(".py") and Path(argv[0]).name != "__main__.py":
        recipe = argv[0]
    else:
        return None
    if recipe.endswith(".py") and not Path(recipe).is_absolute() and command.get("cwd"):
        recipe = str(Path(str(command["cwd"])) / recipe)
    return recipe
