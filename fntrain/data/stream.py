"""Iterable (streaming) datasets: one rank's share of the stream, and where to resume it [S7] [S11].

A stream is read in rows of `dp_size` samples; rank r keeps element r of each row, so every rank gets
the same number of samples (the last, incomplete row is dropped with `drop_last`, else padded by cycling
its own samples), like `DistributedSampler` does for a map-style dataset. The stream's order is its own:
`set_epoch(epoch)` is called when the dataset has it, so a dataset that shuffles per epoch stays a pure
function of (seed, epoch).

Resuming at cursor k: a dataset with `state_dict` / `load_state_dict` is put back where it stood after
the last consumed step (the `StreamPosition` the checkpoint saved); any other stream is re-read from its
start and the first k steps' samples are discarded (warned about once per resume).
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.utils.data

__all__ = ["StreamPosition", "is_stateful", "is_iterable_dataset", "rank_samples", "open_stream"]


def is_iterable_dataset(dataset: Any) -> bool:
    """A stream: iterable, and not indexable by position with a length (the map-style protocol)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    mapped = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    return not mapped and hasattr(dataset, "__iter__")


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


@dataclass(frozen=True)
class StreamPosition:
    """Where a stateful stream stood after the last *consumed* step (not a prefetched one).

    The data iterator records into it as the trainer consumes each step; the checkpoint saves
    `state_dict()` ({"epoch", "cursor", "dataset"}) and gives it back with `load_state_dict` before the
    resumed run starts (see `pipeline.position_hook`). Holds nothing for map-style datasets, whose
    position is the cursor alone.
    """

    _slot: dict[str, Any] = field(default_factory=dict)

    def record(self, epoch: int, cursor: int, dataset_state: Any) -> None:
        self._slot["consumed"] = {"epoch": epoch, "cursor": cursor, "dataset": dataset_state}

    def resume_state(self, epoch: int, cursor: int) -> Any:
        """The dataset state saved for exactly (epoch, cursor), else None."""
        saved = self._slot.get("consumed")
        if saved is not None and saved["epoch"] == epoch and saved["cursor"] == cursor:
            return saved["dataset"]
        return None

    def state_dict(self) -> dict[str, Any]:
        saved = self._slot.get("consumed")
        return {} if saved is None else copy.deepcopy(saved)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            self._slot.pop("consumed", None)
            return
        missing = {"epoch", "cursor", "dataset"} - set(state)
        if missing:
            raise ValueError(f"a stream position needs epoch, cursor and dataset; missing {sorted(missing)}")
        self._slot["consumed"] = {
            "epoch": int(state["epoch"]),
            "cursor": int(state["cursor"]),
            "dataset": copy.deepcopy(state["dataset"]),
        }


def rank_samples(
    stream: Iterator[Any], *, rank: int, world_size: int, drop_last: bool, skip: int = 0
) -> Iterator[Any]:
    """This rank's samples of `stream` after discarding its first `skip` samples: element `rank` of each
    row of `world_size` samples. Closing it closes `stream` (a generator holding a file, say)."""
    try:
        if skip:
            for _ in itertools.islice(stream, skip):
                pass
        if world_size == 1:
            yield from stream
            return
        while True:
            row = list(itertools.islice(stream, world_size))
            if len(row) == world_size:
                yield row[rank]
                continue
            if row and not drop_last:
                yield row[rank % len(row)]
            return
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


def open_stream(
    dataset: Any,
    *,
    epoch: int,
    cursor: int,
    samples_per_step: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    position: StreamPosition | None,
) -> Iterator[Any]:
    """This rank's samples of `epoch`, starting after `cursor` steps; the stream is opened now.

    Raw samples skipped on a count-based resume: cursor x samples_per_step x world_size.
    """
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    skip = 0
    if cursor > 0:
        saved = position.resume_state(epoch, cursor) if position is not None else None
        if saved is not None and is_stateful(dataset):
            dataset.load_state_dict(copy.deepcopy(saved))
        else:
            skip = cursor * samples_per_step * world_size
            reason = (
                "has no saved position for this (epoch, cursor)"
                if is_stateful(dataset)
                else "has no state_dict/load_state_dict"
            )
            warnings.warn(
                f"data: the iterable dataset {type(dataset).__name__} {reason}; resuming epoch {epoch} at "
                f"cursor {cursor} re-reads and discards its first {skip} samples",
                RuntimeWarning,
                stacklevel=3,
            )
    return rank_samples(iter(dataset), rank=rank, world_size=world_size, drop_last=drop_last, skip=skip)
