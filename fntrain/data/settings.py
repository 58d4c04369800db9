"""The data's two settings records: `Batching` (what one data-parallel rank reads per step, in which
order) and `LoaderConfig` (how the samples are read: workers, prefetch, pinned memory, shuffling)."""

from __future__ import annotations

from dataclasses import dataclass

from fntrain.config import require_bool, require_int

__all__ = ["Batching", "LoaderConfig", "IN_PROCESS"]


@dataclass(frozen=True)
class Batching:
    """The batch shape over the data-parallel ranks: `micro_batch_size` samples per micro-batch,
    `micro_batches` micro-batches per optimizer step on this rank (`dp_rank` of `dp_size`), the order
    seeded by (`seed`, epoch); `drop_last` drops (True) or pads (False) the tail that does not divide
    over the ranks, and drops a short last micro-batch."""

    micro_batch_size: int
    micro_batches: int
    seed: int = 42
    dp_rank: int = 0
    dp_size: int = 1
    drop_last: bool = True


@dataclass(frozen=True)
class LoaderConfig:
    """How samples are read: order, worker processes, background prefetch, pinned memory."""

    shuffle: bool = True
    """Shuffle the sample order each epoch (seeded by seed and epoch)."""
    num_workers: int = 0
    """DataLoader worker processes (0 reads in the training process); results do not depend on it."""
    prefetch: bool = False
    """Read the next steps' batches on a background thread; results do not depend on it."""
    prefetch_depth: int = 1
    """Steps the prefetch thread may read ahead."""
    pin_memory: bool = True
    """Page-lock host batches in the background when training on an accelerator (ignored on CPU)."""

    def validate(self, prefix: str = "loader") -> None:
        for name in ("shuffle", "prefetch", "pin_memory"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_int(f"{prefix}.num_workers", self.num_workers, min=0)
        require_int(f"{prefix}.prefetch_depth", self.prefetch_depth, min=1)


# What `build_data` reads with when given no loader: shuffled, in the calling thread, nothing pinned.
IN_PROCESS = LoaderConfig(pin_memory=False)
