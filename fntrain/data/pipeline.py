"""`build_data` and `batches`: the `data(epoch, cursor)` callable of the loop's contract [S11] [S13] [S16].

`batches(spec, epoch, cursor)` yields one global step's micro-batches at a time (a list of collated
micro-batches), starting `cursor` optimizer steps into `epoch`. For a map-style dataset it slices the
epoch's index order at `cursor x micro_batches` micro-batches, so the skipped samples are never read or
collated and resuming costs the same at any cursor. With `num_workers > 0` a torch DataLoader reads the
same micro-batches (its batch sampler starts at the cursor, its worker base seed comes from a generator
seeded by (seed, epoch)), so results do not depend on the worker count; with `prefetch` a background
thread reads ahead, which never changes what step k's batch is.

Steps per epoch = this rank's micro-batches // micro_batches, the arithmetic of `make_run_plan`
(`DistributedSampler` + `DataLoader` lengths); a trailing partial step is never yielded.

The returned iterator must be closed (`train` does: at epoch end, on `StopTraining` and on abort):
closing stops the prefetch thread and the worker processes.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from fntrain.config import require_bool, require_choice, require_int
from fntrain.data.device import can_pin_memory, pin_memory
from fntrain.data.prefetch import Prefetcher
from fntrain.data.sampler import WORKER_STREAM, MicroBatchSampler, epoch_generator, rank_order
from fntrain.data.settings import IN_PROCESS, Batching, LoaderConfig
from fntrain.data.stream import StreamPosition, is_iterable_dataset, is_stateful, open_stream
from fntrain.state import loader_length
from fntrain.stateful import stateful

__all__ = [
    "DataSpec",
    "build_data",
    "batches",
    "data_fn",
    "rank_indices",
    "micro_batch_sampler",
    "dataset_length",
    "steps_per_epoch",
    "position_hook",
]

MULTIPROCESSING_CONTEXTS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class DataSpec:
    """Everything that decides what one data-parallel rank reads in one epoch, and how (frozen).

    `position` records, for a stateful iterable dataset, where the stream stood after the last consumed
    step; the checkpoint saves it (`spec.position.state_dict()`) so that a resume restores the stream
    instead of re-reading it. Map-style datasets resume from the cursor alone.
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    micro_batch_size: int
    micro_batches: int
    shuffle: bool = True
    seed: int = 42
    drop_last: bool = True
    dp_rank: int = 0
    dp_size: int = 1
    num_workers: int = 0
    pin_memory: bool = False
    prefetch: bool = False
    prefetch_depth: int = 1
    multiprocessing_context: str | None = None
    worker_init_fn: Callable[[int], None] | None = None
    position: StreamPosition = field(default_factory=StreamPosition, compare=False, repr=False)

    @property
    def samples_per_step(self) -> int:
        """Samples this rank reads per optimizer step."""
        return self.micro_batch_size * self.micro_batches

    @property
    def iterable(self) -> bool:
        """True for a streaming (iterable) dataset."""
        return is_iterable_dataset(self.dataset)


def build_data(
    dataset: Any,
    batching: Batching,
    loader: LoaderConfig = IN_PROCESS,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    multiprocessing_context: str | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
) -> DataSpec:
    """Validate the data settings and return the frozen spec `batches` reads. Starts nothing.

    dataset: map-style (`__getitem__` + `__len__`) or iterable (a stream; `loader.shuffle` then has no
    effect, the dataset's own `set_epoch` is called each epoch). batching: the batch shape, this rank
    and the order's seed (`Batching`). loader (`LoaderConfig`; default `IN_PROCESS`: shuffled, read in
    the calling thread, nothing pinned): num_workers worker processes of a torch DataLoader (map-style
    datasets only); pin_memory page-locks host batches in the background when an accelerator is present
    (the DataLoader's pin thread, or the prefetch thread); prefetch reads ahead on a background thread,
    prefetch_depth steps deep. multiprocessing_context: start method of the workers (None: torch's).
    """
    _check_settings(batching, loader)
    if multiprocessing_context is not None:
        require_choice("data.multiprocessing_context", multiprocessing_context, MULTIPROCESSING_CONTEXTS)
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"data.collate_fn must be callable, got {collate_fn!r}")
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"data.worker_init_fn must be callable, got {worker_init_fn!r}")
    _check_dataset(dataset, loader.num_workers, loader.shuffle)
    return DataSpec(
        dataset=dataset, collate_fn=collate_fn or default_collate, micro_batch_size=batching.micro_batch_size,
        micro_batches=batching.micro_batches, shuffle=loader.shuffle, seed=batching.seed,
        drop_last=batching.drop_last, dp_rank=batching.dp_rank, dp_size=batching.dp_size,
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, prefetch=loader.prefetch,
        prefetch_depth=loader.prefetch_depth, multiprocessing_context=multiprocessing_context,
        worker_init_fn=worker_init_fn,
    )  # fmt: skip


def _check_settings(batching: Batching, loader: LoaderConfig) -> None:
    """Each setting's type and range, named as the data and loader settings."""
    require_int("data.micro_batch_size", batching.micro_batch_size, min=1)
    require_int("data.micro_batches", batching.micro_batches, min=1)
    require_bool("loader.shuffle", loader.shuffle)
    require_int("data.seed", batching.seed, min=0)
    require_bool("data.drop_last", batching.drop_last)
    require_int("data.dp_size", batching.dp_size, min=1)
    require_int("data.dp_rank", batching.dp_rank, min=0, max=batching.dp_size - 1)
    require_int("loader.num_workers", loader.num_workers, min=0)
    require_bool("loader.pin_memory", loader.pin_memory)
    require_bool("loader.prefetch", loader.prefetch)
    require_int("loader.prefetch_depth", loader.prefetch_depth, min=1)


def _check_dataset(dataset: Any, num_workers: int, shuffle: bool) -> None:
    """A dataset must be map-style or iterable; a stream is read in-process and keeps its own order
    (a TypeError / ValueError naming the setting, a warning for `shuffle`)."""
    if is_iterable_dataset(dataset):
        if num_workers > 0:
            # Each worker would read its own copy of the stream: the order would then depend on the worker
            # count and the stream's position could not be saved. A stream is read in-process (use
            # prefetch=True to overlap its I/O with compute).
            raise ValueError(
                f"loader.num_workers must be 0 for an iterable dataset ({type(dataset).__name__}), got "
                f"{num_workers}; use loader.prefetch to read the stream in the background"
            )
        if shuffle:
            warnings.warn(
                f"loader.shuffle has no effect on the iterable dataset {type(dataset).__name__}: a stream keeps "
                "its own order (its set_epoch(epoch) is called each epoch when it has one)",
                UserWarning,
                stacklevel=3,
            )
    elif not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            "data.dataset must be a map-style dataset (__getitem__ and __len__) or an iterable one, "
            f"got {type(dataset).__name__}"
        )


def dataset_length(spec: DataSpec) -> int | None:
    """Samples in the dataset, or None for an unsized stream (the `dataset_len` of `make_run_plan`)."""
    try:
        return len(spec.dataset)
    except TypeError:
        return None


def steps_per_epoch(spec: DataSpec) -> int | None:
    """Optimizer steps per epoch on every rank (None for an unsized stream): `make_run_plan`'s arithmetic."""
    length = dataset_length(spec)
    if length is None:
        return None
    return loader_length(length, spec.micro_batch_size, spec.dp_size, spec.drop_last) // spec.micro_batches


def rank_indices(spec: DataSpec, epoch: int) -> torch.Tensor:
    """This rank's sample indices for `epoch`, in order (map-style datasets)."""
    return rank_order(
        len(spec.dataset), seed=spec.seed, epoch=epoch, shuffle=spec.shuffle,
        rank=spec.dp_rank, world_size=spec.dp_size, drop_last=spec.drop_last,
    )  # fmt: skip


def micro_batch_sampler(spec: DataSpec, epoch: int, cursor: int) -> MicroBatchSampler:
    """The micro-batches of `epoch` this rank reads from `cursor` on: whole steps only."""
    indices = rank_indices(spec, epoch)
    size = spec.micro_batch_size
    micro_count = len(indices) // size if spec.drop_last else -(-len(indices) // size)
    stop = micro_count // spec.micro_batches * spec.micro_batches
    start = min(cursor * spec.micro_batches, stop)
    return MicroBatchSampler(indices, size, start, stop)


def batches(spec: DataSpec, epoch: int, cursor: int) -> Iterator[list[Any]]:
    """The remaining global batches of `epoch` from `cursor`: each a list of `micro_batches` collated
    micro-batches. Lazy: nothing is read and no thread or process starts before the first `next`;
    `close()` stops whatever started. The dataset's `set_epoch(epoch)` is called first when it has one."""
    require_int("epoch", epoch, min=0)
    require_int("cursor", cursor, min=0)
    if not spec.iterable:
        # A map-style dataset whose samples depend on the epoch (a Mixture) learns it here, before any
        # worker starts, so workers see it too. Streams get theirs in _stream_steps.
        set_epoch = getattr(spec.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
    return _steps(spec, epoch, cursor)


def data_fn(spec: DataSpec) -> Callable[[int, int], Iterator[Sequence[Any]]]:
    """`batches` bound to `spec`: the `data` argument of `train`."""

    def data(epoch: int, cursor: int) -> Iterator[Sequence[Any]]:
        return batches(spec, epoch, cursor)

    return data


def position_hook(spec: DataSpec, name: str = "data_position") -> Any:
    """A no-op hook carrying `spec.position` under the hook `state_dict` protocol, so the checkpoint saves
    a stateful stream's position with each rank's hook states and restores it before the resumed run.
    Put it in the hook list of a run that reads a stateful iterable dataset."""

    def ignore(event: Any, state: Any, info: Any) -> None:
        return None

    return stateful(name, ignore, spec.position.state_dict, spec.position.load_state_dict)


# ----------------------------------------------------------------------------- internals


def _steps(spec: DataSpec, epoch: int, cursor: int) -> Iterator[list[Any]]:
    """The iterator `batches` returns. Its `finally` owns every resource it started."""
    loader: Any = None
    source: Any = None
    try:
        if spec.iterable:
            source = _stream_steps(spec, epoch, cursor)
        else:
            sampler = micro_batch_sampler(spec, epoch, cursor)
            if spec.num_workers > 0 and len(sampler):
                # Workers are forked here, in the consuming thread, before any prefetch thread exists.
                loader = iter(_data_loader(spec, epoch, sampler))
                source = _whole_steps(loader, spec.micro_batches)
            else:
                source = _whole_steps(_read_micro_batches(spec, sampler), spec.micro_batches)
        if spec.prefetch:
            pin_here = spec.pin_memory and spec.num_workers == 0 and can_pin_memory()
            source = Prefetcher(source, spec.prefetch_depth, transform=_pin_step if pin_here else None)
        step = cursor
        for batch, stream_state in source:
            step += 1
            if stream_state is not None:
                # Recorded when the trainer takes the batch, so the saved position is never a prefetched one.
                spec.position.record(epoch, step, stream_state)
            yield batch
    finally:
        clean = True
        if isinstance(source, Prefetcher):
            clean = source.stop()
        elif source is not None:
            source.close()
        if loader is not None and clean:
            # A timed-out prefetch thread still uses the loader; it is shut down when released instead.
            _shutdown_workers(loader)
        del loader, source


def _shutdown_workers(loader: Any) -> None:
    """End a DataLoader iterator's worker processes now, and the feeder threads of its index queues.

    torch's own shutdown closes those queues without joining their feeder threads (they exit a moment
    later); joining them here keeps the promise that no thread outlives the iterator's close().
    """
    shutdown = getattr(loader, "_shutdown_workers", None)
    if shutdown is None:
        return
    shutdown()
    for index_queue in getattr(loader, "_index_queues", ()):
        feeder = getattr(index_queue, "_thread", None)
        if feeder is not None:
            feeder.join(timeout=1.0)


def _data_loader(spec: DataSpec, epoch: int, sampler: MicroBatchSampler) -> DataLoader:
    return DataLoader(
        spec.dataset,
        batch_sampler=sampler,
        num_workers=spec.num_workers,
        collate_fn=spec.collate_fn,
        pin_memory=spec.pin_memory and can_pin_memory(),
        # Without a generator, iter(DataLoader) draws the worker base seed from the global RNG.
        generator=epoch_generator(spec.seed, epoch, WORKER_STREAM),
        multiprocessing_context=spec.multiprocessing_context,
        worker_init_fn=spec.worker_init_fn,
    )


def _read_micro_batches(spec: DataSpec, sampler: MicroBatchSampler) -> Iterator[Any]:
    """In-process reading, exactly as a DataLoader worker fetches (`__getitems__` when the dataset has it)."""
    dataset, collate = spec.dataset, spec.collate_fn
    getitems = getattr(dataset, "__getitems__", None)
    for indices in sampler:
        samples = getitems(indices) if getitems else [dataset[i] for i in indices]
        yield collate(samples)


def _whole_steps(micro: Iterator[Any], micro_batches: int) -> Iterator[tuple[list[Any], None]]:
    """Group micro-batches into steps; a trailing partial step is not yielded."""
    while True:
        group = list(itertools.islice(micro, micro_batches))
        if len(group) < micro_batches:
            return
        yield group, None


def _stream_steps(spec: DataSpec, epoch: int, cursor: int) -> Iterator[tuple[list[Any], Any]]:
    """Steps of an iterable dataset with, for a stateful one, its position after each step's samples."""
    dataset, collate = spec.dataset, spec.collate_fn
    samples = open_stream(
        dataset, epoch=epoch, cursor=cursor, samples_per_step=spec.samples_per_step,
        rank=spec.dp_rank, world_size=spec.dp_size, drop_last=spec.drop_last, position=spec.position,
    )  # fmt: skip
    stateful = is_stateful(dataset)
    size, count = spec.micro_batch_size, spec.micro_batches
    try:
        while True:
            chunks: list[list[Any]] = []
            while len(chunks) < count:
                chunk = list(itertools.islice(samples, size))
                if not chunk or (len(chunk) < size and spec.drop_last):
                    return  # the stream ran out: the epoch ends, a partial step is dropped [S7] [S13]
                chunks.append(chunk)
                if len(chunk) < size:
                    break
            if len(chunks) < count:
                return
            # Taken before reading on, so it is the position right after this step's samples.
            state = copy.deepcopy(dataset.state_dict()) if stateful else None
            yield [collate(chunk) for chunk in chunks], state
    finally:
        samples.close()


def _pin_step(item: tuple[list[Any], Any]) -> tuple[list[Any], Any]:
    batch, stream_state = item
    return pin_memory(batch), stream_state
