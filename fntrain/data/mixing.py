"""Weighted mixing of several map-style sources into one map-style dataset [S11].

`Mixture(sources, weights)` is a view of `samples_per_epoch` samples. Its index space is cut into rounds
of `resolution` slots; each round gives source s round(w_s x resolution) slots (largest remainders, so
the counts sum exactly), spread evenly through the round (stride scheduling: every prefix of a round is
within one sample of the weights). Slot i of the view is thus a pure function of i: the k-th slot of
source s in the epoch. That slot is read from source s as from an endless stream: epoch e's slots are the
stream's ordinals [e x n_s, (e + 1) x n_s) (n_s = source s's slots per epoch); the stream walks the source
in passes, each pass a permutation of the whole source drawn from a key derived from (seed, pass, s)
(shuffle=False: in order). A downsampled source therefore shows new samples each epoch until it has
shown them all, an upsampled one repeats each sample evenly.

Everything is arithmetic on the index: no per-sample table, so the view costs O(resolution) memory
whatever the sources' sizes. The pipeline's sampler then orders (and shards) the view per (seed, epoch),
and its cursor resumes it exactly at any step, like any map-style dataset.

The epoch: a Mixture reads epoch e's slots after `set_epoch(e)`, which `pipeline.batches` calls before
each epoch's batches, so a downsampled source shows a new subset every epoch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fntrain.config import require_bool, require_int
from fntrain.data.sampler import epoch_seed

__all__ = ["Mixture", "mixture_counts", "interleave", "permute_index", "MIX_STREAM"]

MIX_STREAM = 1 << 16
"""First stream of `sampler.epoch_seed` used for the per-source permutations (stream MIX_STREAM + s)."""
DEFAULT_RESOLUTION = 1 << 16

_MASK64 = (1 << 64) - 1


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """Integer counts summing to `total`, proportional to `weights` (largest remainders; ties to the
    earlier source)."""
    weights = [float(w) for w in weights]
    scale = sum(weights)
    exact = [w / scale * total for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda s: (-(exact[s] - counts[s]), s))
    for s in order[: total - sum(counts)]:
        counts[s] += 1
    return counts


def interleave(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, ordinal) of each slot of a round holding `counts[s]` slots of source s, spread evenly:
    slot times (k + 1/2) / counts[s], sorted (ties to the earlier source). ordinal = k."""
    sources = np.concatenate([np.full(c, s, dtype=np.int64) for s, c in enumerate(counts)])
    ordinals = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    times = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c] or [np.empty(0)])
    order = np.lexsort((sources, times))
    return sources[order], ordinals[order]


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a bijective scramble of a 64-bit int."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def permute_index(index: int, size: int, key: int) -> int:
    """A pseudo-random permutation of range(size) evaluated at `index` (O(1) memory): a 4-round Feistel
    network over the smallest even-bit power of two >= size, walked until it lands inside the range."""
    if size <= 1:
        return 0
    half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
    half_mask = (1 << half_bits) - 1
    value = index
    while True:
        left, right = value >> half_bits, value & half_mask
        for round_key in range(4):
            left, right = (
                right,
                left ^ (_mix64(right ^ ((key + round_key * 0x9E3779B97F4A7C15) & _MASK64)) & half_mask),
            )
        value = (left << half_bits) | right
        if value < size:
            return value


class Mixture(torch.utils.data.Dataset):
    """A weighted mix of map-style `sources` (see the module docstring).

    weights: one non-negative number per source (normalized; at least one positive).
    samples_per_epoch: the view's length (default: the sources' total length).
    seed: keys the per-source permutations (use the run's seed). shuffle: permute each source's passes.
    source_key: when set and samples are dicts, each sample gets the index of its source under this key
    (an int64 tensor), e.g. for per-source metrics.
    resolution: slots per round (weights are honoured to 1/resolution); capped at samples_per_epoch.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        *,
        samples_per_epoch: int | None = None,
        seed: int = 42,
        shuffle: bool = True,
        source_key: str | None = None,
        resolution: int = DEFAULT_RESOLUTION,
    ):
        if isinstance(weights, Mapping) or len(weights) != len(sources) or not sources:
            raise ValueError(
                f"mixing needs one weight per source: {len(sources)} sources, weights {weights!r}"
            )
        for number, weight in enumerate(weights):
            if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)):
                raise TypeError(f"mixing weights must be numbers, got weights[{number}] = {weight!r}")
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(
                    f"mixing weights must be finite numbers >= 0, got weights[{number}] = {weight!r}"
                )
        if sum(weights) <= 0:
            raise ValueError(f"mixing needs a positive weight, got {list(weights)!r}")
        for number, (source, weight) in enumerate(zip(sources, weights, strict=True)):
            if not (hasattr(source, "__getitem__") and hasattr(source, "__len__")):
                raise TypeError(
                    f"mixing source {number} must be a map-style dataset, got {type(source).__name__}"
                )
            if weight > 0 and len(source) == 0:
                raise ValueError(f"mixing source {number} is empty but has weight {weight}")
        require_int("seed", seed, min=0)
        require_bool("shuffle", shuffle)
        require_int("resolution", resolution, min=1)
        length = sum(len(s) for s in sources) if samples_per_epoch is None else samples_per_epoch
        require_int("samples_per_epoch", length, min=1)
        self.sources = list(sources)
        self.weights = tuple(float(w) / sum(weights) for w in weights)
        self.samples_per_epoch = length
        self.seed = seed
        self.shuffle = shuffle
        self.source_key = source_key
        self.epoch = 0
        self.round = min(resolution, length)
        self.round_counts = mixture_counts(self.weights, self.round)
        self._slot_source, self._slot_ordinal = interleave(self.round_counts)
        rounds, tail = divmod(length, self.round)
        tail_counts = np.bincount(self._slot_source[:tail], minlength=len(self.sources))
        self.epoch_counts = tuple(
            rounds * c + int(t) for c, t in zip(self.round_counts, tail_counts, strict=True)
        )
        """Samples each source contributes to every epoch (sums to samples_per_epoch)."""

    def __len__(self) -> int:
        return self.samples_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch`'s slots of each source from now on."""
        require_int("epoch", epoch, min=0)
        self.epoch = epoch

    @property
    def proportions(self) -> tuple[float, ...]:
        """The fraction of each epoch that each source fills (the weights, to 1/resolution)."""
        return tuple(c / self.samples_per_epoch for c in self.epoch_counts)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, index in that source) of the view's sample `index` in the current epoch."""
        if not -self.samples_per_epoch <= index < self.samples_per_epoch:
            raise IndexError(f"mixture index {index} is outside [-{self.samples_per_epoch}, {self.samples_per_epoch})")
        if index < 0:
            index += self.samples_per_epoch
        round_number, slot = divmod(index, self.round)
        source = int(self._slot_source[slot])
        ordinal = round_number * self.round_counts[source] + int(self._slot_ordinal[slot])
        stream_position = self.epoch * self.epoch_counts[source] + ordinal
        size = len(self.sources[source])
        passes, position = divmod(stream_position, size)
        if self.shuffle:
            position = permute_index(position, size, epoch_seed(self.seed, passes, MIX_STREAM + source))
        return source, position

    def __getitem__(self, index: int) -> Any:
        source, position = self.locate(index)
        sample = self.sources[source][position]
        if self.source_key is not None and isinstance(sample, Mapping):
            sample = {**sample, self.source_key: torch.tensor(source, dtype=torch.int64)}
        return sample

    def __repr__(self) -> str:
        weights = ", ".join(f"{w:.4g}" for w in self.weights)
        return f"Mixture(sources={len(self.sources)}, weights=({weights}), samples_per_epoch={self.samples_per_epoch})"
