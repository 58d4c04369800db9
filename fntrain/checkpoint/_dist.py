"""The few process-group facts the checkpoint needs; all of them work without a process group."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["initialized", "rank", "world_size", "barrier", "broadcast_text", "agree", "quiet_single_process"]

SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if initialized() else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def barrier(group: Any = None) -> None:
    if initialized():
        dist.barrier(group=group)


def broadcast_text(text: str | None, group: Any = None) -> str | None:
    """Rank 0's `text` on every rank (a string or None)."""
    if not initialized():
        return text
    box = [text]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(problem: str | None, group: Any = None) -> str | None:
    """The first rank's problem (a string), or None when no rank has one, on every rank alike (a
    collective in place of a barrier: ranks that fail and ranks that do not leave it together)."""
    if not initialized():
        return problem
    found: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, problem, group=group)
    return next((text for text in found if text is not None), None)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: that intent is explicit."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield
