"""P4 resume cost: time to the first batch at cursor 10,000 vs cursor 10 on the same dataset (goal <= 1.1x).

fntrain's data order is a pure function of (seed, epoch, rank, world), so resuming slices the epoch's index
order at the cursor and never reads the skipped samples: the cost is one `randperm` of the epoch whatever the
cursor. Rows: in-process reading, 2 DataLoader workers (their start-up included in both), and, for scale, what
a resume costs a loader that has to be iterated up to the cursor (reading and collating every skipped batch).
Run: `python -m bench.resume_cost [--quick]`.
"""

from __future__ import annotations

import itertools
import time

import torch
from torch.utils.data import DataLoader, RandomSampler

from bench.harness import Row, bench_main, interleave, paired_ratio_row, ratio_row
from fntrain.data.pipeline import batches, build_data
from fntrain.data.sampler import epoch_generator
from fntrain.data.settings import Batching, LoaderConfig

MICRO_BATCH_SIZE = 8
MICRO_BATCHES = 4
NEAR = 10


class Tokens(torch.utils.data.Dataset):
    """A synthetic token dataset: sample i is 128 token ids derived from i (cheap, deterministic)."""

    def __init__(self, length: int, context: int = 128):
        self.length, self.context = length, context

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.context) + index) % 256
        return {"input_ids": ids, "labels": ids}


def _first_batch(spec, cursor: int) -> int:
    iterator = batches(spec, 0, cursor)
    next(iterator)
    iterator.close()
    return 1


def _skip_by_iteration(dataset, cursor: int) -> float:
    """Seconds to the first batch at `cursor` for a loader that must be iterated there (the usual resume)."""
    loader = DataLoader(
        dataset, batch_size=MICRO_BATCH_SIZE, drop_last=True,
        sampler=RandomSampler(dataset, generator=epoch_generator(0, 0)),
    )  # fmt: skip
    started = time.perf_counter()
    iterator = iter(loader)
    next(itertools.islice(iterator, cursor * MICRO_BATCHES, None))
    return time.perf_counter() - started


def run(quick: bool = False) -> list[Row]:
    far = 1_000 if quick else 10_000
    repeats = 3 if quick else 21
    dataset = Tokens((far + NEAR + 1) * MICRO_BATCH_SIZE * MICRO_BATCHES)
    rows: list[Row] = []
    for label, workers, goal in (("in-process", 0, 1.1), ("2 workers", 2, 1.1)):
        spec = build_data(
            dataset,
            Batching(MICRO_BATCH_SIZE, MICRO_BATCHES, seed=0),
            LoaderConfig(num_workers=workers, pin_memory=False),
        )
        near_name, far_name = f"cursor {NEAR}", f"cursor {far}"
        timing = interleave(
            {near_name: lambda spec=spec: _first_batch(spec, NEAR), far_name: lambda spec=spec: _first_batch(spec, far)},
            repeats=repeats if workers == 0 else max(3, repeats // 2),
        )  # fmt: skip
        rows.append(
            paired_ratio_row(
                f"P4 resume ({label}, {len(dataset):,} samples): first batch at cursor {far:,} vs {NEAR}",
                timing, far_name, near_name, unit="ms", goal_ratio=goal,
                note="both slice the same epoch order (one randperm of the dataset); the skipped samples are never read"
                + (", and both pay the workers' start-up" if workers else "") + ".",
            )
        )  # fmt: skip
        if workers == 0:
            in_process_far = timing.median(far_name)
    skip = _skip_by_iteration(dataset, far)
    rows.append(
        ratio_row(
            f"P4 resume at cursor {far:,}: iterate-and-discard DataLoader vs fntrain",
            skip * 1e3, in_process_far * 1e3, unit="ms", goal_ratio=None,
            note="a loader without a cursor reads and collates every skipped batch (one run, for scale).",
        )
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    bench_main(run, "Resume cost", __doc__)
