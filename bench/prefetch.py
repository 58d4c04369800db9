"""P3 prefetch: with a step of C ms of compute (torch threads = 1) and a dataset that spends L ms per batch
outside the GIL (sleeping, like file or network I/O), `--loader.prefetch` should bring the step time down from
L + C to max(L, C): goal <= 1.10 x max(L, C), for L = C = 20 ms and L = 2C.

Each configuration runs `train()` five ways, interleaved: with `--loader.prefetch`, with a hand-written
prefetch (a plain thread filling a `queue.Queue` of the same depth, what one writes without fntrain),
without prefetch, compute only (batches already in memory) and loading only (the data iterator alone);
max(L, C) is the larger of the last two as measured in the same round. Full runs measure in PROCESSES
fresh processes one after another, so the interval carries what differs between processes (Method in
RESULTS.md). The rows are wall time on purpose (their subject is a thread sleeping while another computes),
so each step also pays the wake-ups of a thread hand-over, which grow on a busy machine; the hand-written
prefetch pays the same, and the row against it shows what fntrain's prefetcher itself costs.
Run: `python -m bench.prefetch [--quick]`.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from bench.harness import Row, Timing, bench_main, in_fresh_processes, interleave, paired_ratio_row
from fntrain import RunPlan, TrainState, train
from fntrain.data.pipeline import batches, build_data, data_fn
from fntrain.data.settings import Batching, LoaderConfig

PROCESSES = 3  # full runs measure in this many fresh processes, one after another


class SlowReads(torch.utils.data.Dataset):
    """Every sample costs `latency_s` of sleeping (the GIL is released, as in real I/O)."""

    def __init__(self, length: int, latency_s: float):
        self.length, self.latency_s = length, latency_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.latency_s)
        return {"x": torch.full((64,), float(index))}


def _compute_step(compute_s: float):
    """A step function doing about `compute_s` of matrix multiplications on one thread."""
    a = torch.randn(192, 192)
    for _ in range(5):
        a @ a
    started = time.perf_counter()
    for _ in range(50):
        a @ a
    repeats = max(1, round(compute_s / ((time.perf_counter() - started) / 50)))

    def step_fn(state, batch):
        out = batch[0]["x"].sum()
        for _ in range(repeats):
            out = out + (a @ a)[0, 0]
        return {"loss": out}

    return step_fn


def _variants(load_s: float, compute_s: float, steps: int):
    plan = RunPlan(train_iters=steps, steps_per_epoch=steps, epochs=1)
    dataset = SlowReads(steps, load_s)
    plain = build_data(dataset, Batching(1, 1), LoaderConfig(shuffle=False, pin_memory=False))
    prefetched = build_data(dataset, Batching(1, 1), LoaderConfig(shuffle=False, prefetch=True, pin_memory=False))
    in_memory = [[{"x": torch.full((64,), float(i))}] for i in range(steps)]
    step_fn = _compute_step(compute_s)

    def with_data(data):
        def run() -> int:
            train(TrainState(), step_fn, [], data=data, plan=plan)
            return steps

        return run

    def load_only() -> int:
        iterator = batches(plain, 0, 0)
        for _ in iterator:
            pass
        return steps

    def by_hand(epoch: int, cursor: int):
        return _thread_prefetch(batches(plain, epoch, cursor))

    return {
        "prefetch": with_data(data_fn(prefetched)),
        "hand-written prefetch": with_data(by_hand),
        "no prefetch": with_data(data_fn(plain)),
        "compute only": with_data(lambda epoch, cursor: iter(in_memory[cursor:])),
        "load only": load_only,
    }


def _thread_prefetch(source, depth: int = 1):
    """The hand-written baseline: a daemon thread reads `source` into a bounded queue; a sentinel ends it."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        for item in source:
            slots.put(item)
        slots.put(done)

    threading.Thread(target=fill, daemon=True).start()
    while (item := slots.get()) is not done:
        yield item


def measure(load_ms: float, compute_ms: float, steps: int, repeats: int) -> Timing:
    """One process's interleaved rounds of the five variants (torch on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return interleave(_variants(load_ms / 1e3, compute_ms / 1e3, steps), repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def run(quick: bool = False) -> list[Row]:
    steps, repeats, processes = (6, 2, 1) if quick else (20, 12 // PROCESSES, PROCESSES)
    rows: list[Row] = []
    for load_ms, compute_ms in ((20, 20), (40, 20)):
        timing = in_fresh_processes(
            measure, processes, load_ms=load_ms, compute_ms=compute_ms, steps=steps, repeats=repeats
        )
        # max(L, C) of each round, as a pseudo-variant paired with that round's prefetch run
        timing.samples["max(L, C)"] = [
            max(compute, load)
            for compute, load in zip(timing.samples["compute only"], timing.samples["load only"], strict=True)
        ]
        config = f"L = {load_ms} ms, C = {compute_ms} ms"
        rows.append(
            paired_ratio_row(
                f"P3 prefetch, {config}: step time vs max(L, C)",
                timing, "prefetch", "max(L, C)", unit="ms", goal_ratio=1.10,
                note=f"without prefetch a step takes {timing.median('no prefetch') * 1e3:.1f} ms (L + C); "
                "the depth-1 queue hides the load behind the compute (each run's first step, which fills "
                "the queue, is included, and so are the thread hand-over's wake-ups).",
            )
        )  # fmt: skip
        rows.append(
            paired_ratio_row(
                f"P3 prefetch, {config}: fntrain's prefetch vs a hand-written prefetch thread",
                timing, "prefetch", "hand-written prefetch", unit="ms", goal_ratio=None,
                note="the same depth-1 overlap written as a thread and a queue.Queue: what the prefetcher's "
                "own bookkeeping (cursor record, shutdown, error passing) costs.",
            )
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    bench_main(run, "Prefetch", __doc__)
