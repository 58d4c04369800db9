"""The data path: a deterministic order per (seed, epoch, rank, world), a cursor that is just a number,
optional DataLoader workers and a background prefetch thread, token counting and device transfer.

`build_data(dataset, Batching(...), LoaderConfig(...))` returns a frozen `DataSpec`; `data_fn(spec)` is
the `data(epoch, cursor)` callable of `train`; `count_batch` is its `count_batch`.
"""

from fntrain.data.pipeline import DataSpec, batches, build_data, data_fn, dataset_length, steps_per_epoch
from fntrain.data.prefetch import Prefetcher
from fntrain.data.settings import IN_PROCESS, Batching, LoaderConfig
from fntrain.data.stream import StreamPosition
from fntrain.data.tokens import (
    IGNORE_INDEX,
    count_batch,
    count_loss_tokens,
    count_samples,
    count_tokens,
    loss_targets,
)

__all__ = [
    "DataSpec",
    "Batching",
    "LoaderConfig",
    "IN_PROCESS",
    "build_data",
    "batches",
    "data_fn",
    "dataset_length",
    "steps_per_epoch",
    "Prefetcher",
    "StreamPosition",
    "IGNORE_INDEX",
    "count_batch",
    "count_loss_tokens",
    "count_samples",
    "count_tokens",
    "loss_targets",
]
