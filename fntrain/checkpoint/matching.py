"""Which parts of a checkpoint fit the live state [S36]: missing model keys are an error naming them,
extra ones a warning (unless the live model is one pipeline stage), a shape mismatch an error; missing
optimizer / scheduler / scaler state is a warning and that section starts fresh. A tied weight's
optimizer state is found under any of its names. Reads only the checkpoint's metadata and JSON files."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fntrain.checkpoint.tree import dcp_key, leaves

__all__ = ["MissingKeysError", "KeyMatch", "match_keys", "check_optional_sections"]

log = logging.getLogger("fntrain.checkpoint")

_SHOWN = 8  # key names listed in a message before "... and N more"


class MissingKeysError(KeyError):
    """The checkpoint lacks state the live model needs; the message names the keys."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _names(keys: Iterable[str], strip: str = "") -> str:
    keys = sorted(keys)
    shown = [key[len(strip) :] if strip and key.startswith(strip) else key for key in keys[:_SHOWN]]
    more = f" ... and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(shown) + more


def _global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)  # a DTensor reports its global shape


@dataclass(frozen=True)
class KeyMatch:
    """The live state's tensors (DCP key -> tensor), the section of each key ("model", "optimizer", ...),
    the keys the checkpoint lacks, and the saved key of each live key saved under another name."""

    live_tensors: dict[str, torch.Tensor]
    sections: dict[str, str]
    missing: frozenset[str]
    aliased: dict[str, str]


def match_keys(
    path: Path, live: dict[str, Any], metadata: dict[str, Any], tied: list[list[str]], model_part: bool
) -> KeyMatch:
    """Match the live state tree `live` with the checkpoint's DCP `metadata` (see `_check_live_tensors`
    for what fails)."""
    live_tensors = {dcp_key(p): leaf for p, leaf in leaves(live) if isinstance(leaf, torch.Tensor)}
    sections = {key: key.split(".", 1)[0] for key in live_tensors}
    missing = {key for key in live_tensors if key not in metadata}
    aliased = _tied_aliases(missing, metadata, tied)  # live key -> the key it was saved under
    missing -= set(aliased)
    _check_live_tensors(path, live_tensors, metadata, missing, sections, model_part)
    return KeyMatch(live_tensors, sections, frozenset(missing), aliased)


def _check_live_tensors(
    path: Path,
    live_tensors: dict[str, torch.Tensor],
    metadata: dict[str, Any],
    missing: set[str],
    sections: dict[str, str],
    model_part: bool = False,
) -> None:
    """Missing model keys are a MissingKeysError, extra model keys a warning (unless the live model is
    one pipeline stage: the other stages' keys), and a saved tensor whose shape differs from the live
    one a ValueError."""
    missing_model = {key for key in missing if sections[key] == "model"}
    if missing_model:
        raise MissingKeysError(
            f"checkpoint {path} lacks model keys the model needs: {_names(missing_model, 'model.')}"
        )
    unexpected = {key for key in metadata if key.startswith("model.") and key not in live_tensors}
    if unexpected and not model_part:
        log.warning(
            "checkpoint %s has model keys the model does not: %s (ignored)",
            path,
            _names(unexpected, "model."),
        )
    for key, leaf in live_tensors.items():
        entry = metadata.get(key)
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != _global_shape(leaf):
            raise ValueError(
                f"checkpoint {path}: {key} has shape {tuple(entry.size)}, the live state {_global_shape(leaf)}"
            )


def _section_saved(section: str, metadata: dict[str, Any], saved_values: dict[tuple[Any, ...], Any]) -> bool:
    """Whether the checkpoint holds any tensor or value of `section` ("optimizer", "schedulers", ...)."""
    return any(key.startswith(section + ".") for key in metadata) or any(
        p[0] == section for p in saved_values
    )


def _tied_aliases(missing: set[str], metadata: dict[str, Any], tied: list[list[str]]) -> dict[str, str]:
    """For missing optimizer keys of a tied weight (a pipeline stage holds the output head under its own
    name; a one-rank run saved its state under the embedding's), the saved key of the same state."""
    found: dict[str, str] = {}
    for key in missing:
        if not key.startswith("optimizer.state."):
            continue
        for names in tied:
            for name in names:
                prefix = f"optimizer.state.{name}."
                if key.startswith(prefix):
                    field = key[len(prefix) :]
                    saved = next(
                        (
                            f"optimizer.state.{a}.{field}"
                            for a in names
                            if f"optimizer.state.{a}.{field}" in metadata
                        ),
                        None,
                    )
                    if saved is not None:
                        found[key] = saved
    return found


def _same_groups(
    live: list[list[str]], saved: list[list[str] | None], path: Path, tied: list[list[str]] = ()
) -> bool:
    """Whether the live optimizer's parameter groups are those saved. Under pipeline parallelism every
    stage saved its own groups (in its rank file; meta.json holds rank 0's), and a run at another layout
    holds another part of the model: each live group must lie within the union of the same group over
    every saved stage, and the groups must be as many."""
    merged = [set(group or ()) for group in saved]
    for rank_file in sorted(path.glob("rank_*.json")):
        for index, group in enumerate(json.loads(rank_file.read_text()).get("optimizer_groups", [])):
            if index >= len(merged):
                return False
            merged[index].update(group)
    for names in tied:  # a tied weight is in a group under any of its names
        for group in merged:
            if group & set(names):
                group.update(names)
    return len(live) == len(merged) and all(set(group or ()) <= merged[i] for i, group in enumerate(live))


def check_optional_sections(
    path: Path,
    live: dict[str, Any],
    metadata: dict[str, Any],
    saved_values: dict[tuple[Any, ...], Any],
    missing: set[str],
    sections: dict[str, str],
    tied: list[list[str]] = (),
) -> set[str]:
    """Warn about optimizer / scheduler / scaler state the checkpoint lacks; return sections to skip."""
    skip = set()
    for section in ("optimizer", "schedulers", "grad_scaler"):
        if section in live and not _section_saved(section, metadata, saved_values):
            warnings.warn(f"checkpoint {path} has no {section} state; it starts fresh", stacklevel=3)
            skip.add(section)
    if "optimizer" in live and "optimizer" not in skip:
        live_groups = [group.get("params") for group in live["optimizer"].get("param_groups", [])]
        saved_groups: dict[int, list[str]] = {}
        for tree_path, value in saved_values.items():
            if (
                tree_path[:2] == ("optimizer", "param_groups")
                and len(tree_path) == 5
                and tree_path[3] == "params"
            ):
                saved_groups.setdefault(tree_path[2], []).append(value)
        if not _same_groups(live_groups, [saved_groups.get(i) for i in range(len(saved_groups))], path, tied):
            warnings.warn(
                f"checkpoint {path}: the optimizer's parameter groups differ from the saved ones; "
                "optimizer state not restored (it starts fresh)",
                stacklevel=3,
            )
            skip.add("optimizer")
        else:
            missing_optimizer = {key for key in missing if sections[key] == "optimizer"}
            if missing_optimizer:
                warnings.warn(
                    f"checkpoint {path} lacks optimizer state for: {_names(missing_optimizer, 'optimizer.state.')}; "
                    "those entries keep their fresh values",
                    stacklevel=3,
                )
    if "schedulers" in live and "schedulers" not in skip:
        saved_count = 1 + max((p[1] for p in saved_values if p[0] == "schedulers"), default=-1)
        if saved_count != len(live["schedulers"]):
            warnings.warn(
                f"checkpoint {path} has {saved_count} LR scheduler state(s), the run {len(live['schedulers'])}; "
                "restoring the first min of both",
                stacklevel=3,
            )
    return skip
