"""State trees split into tensors (for DCP) and JSON leaves (for meta.json), and put back together.

A state tree is nested dicts (string keys), lists and tuples whose leaves are tensors or plain values.
Tensors go to torch.distributed.checkpoint under flat dotted keys ("optimizer.state.tok.weight.exp_avg",
the keys DCP's own flattening would give); every other leaf is stored as JSON beside its path. Restoring
rebuilds from the *live* tree's structure, so tuples stay tuples and keys the checkpoint lacks are known.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["TreePath", "leaves", "dcp_key", "split", "rebuild", "json_leaf", "decode_value"]

TreePath = tuple[Any, ...]  # dict keys (str) and list/tuple indices (int)


def leaves(tree: Any, prefix: TreePath = ()) -> Iterator[tuple[TreePath, Any]]:
    """(path, leaf) for every leaf, depth first, in container order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            if not isinstance(key, str):
                raise TypeError(f"state key {key!r} at {dcp_key(prefix) or '<root>'} must be a str")
            yield from leaves(value, (*prefix, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from leaves(value, (*prefix, index))
    else:
        yield prefix, tree


def dcp_key(path: TreePath) -> str:
    return ".".join(str(part) for part in path)


def json_leaf(path: TreePath, value: Any) -> Any:
    """`value` as a JSON scalar, or a TypeError naming the path: only plain data is stored."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalars
        return value.item()
    raise TypeError(
        f"checkpoint state {dcp_key(path)!r} holds a {type(value).__name__}; only tensors and "
        "JSON values (None, bool, int, float, str) can be saved without pickling"
    )


def split(tree: Any) -> tuple[dict[str, torch.Tensor], list[list[Any]]]:
    """({dcp_key: tensor}, [[path, json value], ...]) for `tree`; colliding flat keys are an error."""
    tensors: dict[str, torch.Tensor] = {}
    values: list[list[Any]] = []
    for path, leaf in leaves(tree):
        if isinstance(leaf, torch.Tensor):
            key = dcp_key(path)
            if key in tensors:
                raise ValueError(f"two state entries flatten to the same checkpoint key {key!r}")
            tensors[key] = leaf
        else:
            value = json_leaf(path, leaf)
            if isinstance(value, float) and not math.isfinite(value):
                value = {"float": repr(value)}  # inf/nan: JSON has no literal for them
            values.append([list(path), value])
    return tensors, values


def decode_value(value: Any) -> Any:
    """Inverse of the non-finite float encoding in `split`."""
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    return value


def rebuild(tree: Any, replace: Callable[[TreePath, Any], Any], prefix: TreePath = ()) -> Any:
    """A copy of `tree` (same containers, tuples kept) with each leaf replaced by `replace(path, leaf)`."""
    if isinstance(tree, Mapping):
        return {key: rebuild(value, replace, (*prefix, key)) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(rebuild(value, replace, (*prefix, index)) for index, value in enumerate(tree))
    return replace(prefix, tree)
