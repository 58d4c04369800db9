"""The benchmark harness: compared variants alternate within one process, and every comparison is a set of
per-round paired differences (variant - baseline, measured in the same round) summarised by their median
and a seeded bootstrap 95% interval.

These machines are noisy, so absolute times mean little. Pairing within a round cancels the slow drift
(another process starting, the clock changing) that moves both variants alike; the interval then says how
far the remaining round-to-round variation leaves the median uncertain. A goal is "met" only when the
whole interval is within it, "NOT met" only when the whole interval is past it, and "undecided" otherwise.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "Row", "Timing", "Interval", "interleave", "bootstrap_median", "verdict", "rounds_to_decide",
    "overhead_row", "ratio_row", "paired_ratio_row", "format_table", "append_results", "machine",
    "machine_info", "write_json",
]  # fmt: skip

RESULTS = Path(__file__).with_name("RESULTS.md")
CONFIDENCE = 0.95
RESAMPLES = 4000
SEED = 0


@dataclass(frozen=True)
class Interval:
    """The median of paired samples and its bootstrap interval, from `n` rounds."""

    median: float
    low: float
    high: float
    n: int

    @property
    def width(self) -> float:
        return self.high - self.low


def bootstrap_median(
    samples: Sequence[float], *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED
) -> Interval:
    """The median of `samples` with a percentile-bootstrap interval (resampling with replacement, seeded:
    the same samples always give the same interval). One sample gives a zero-width interval."""
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        raise ValueError("bootstrap_median needs at least one sample, got none")
    median = float(np.median(values))
    if values.size == 1:
        return Interval(median, median, median, 1)
    rng = np.random.default_rng(seed)
    medians = np.median(values[rng.integers(0, values.size, size=(resamples, values.size))], axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return Interval(median, float(low), float(high), int(values.size))


def verdict(interval: Interval, goal: float | None, *, lower_is_better: bool = True) -> str:
    """The goal's verdict: "met" when the whole interval is within `goal`, "NOT met" when the whole
    interval is past it, "undecided" otherwise; "-" without a goal."""
    if goal is None:
        return "-"
    if lower_is_better:
        return "met" if interval.high <= goal else ("NOT met" if interval.low > goal else "undecided")
    return "met" if interval.low >= goal else ("NOT met" if interval.high < goal else "undecided")


def rounds_to_decide(interval: Interval, goal: float) -> int | None:
    """About how many rounds in all would make an undecided interval clear `goal`, taking its half-width
    to shrink as 1/sqrt(rounds) around the same median; None when the median sits on the goal."""
    distance = abs(goal - interval.median)
    if distance == 0 or interval.n < 2:
        return None
    # The interval may be lopsided: the side facing the goal is the one that has to shrink.
    reach = interval.high - interval.median if goal > interval.median else interval.median - interval.low
    if reach <= distance:
        return interval.n
    return math.ceil(interval.n * (reach / distance) ** 2)


@dataclass(frozen=True)
class Row:
    """One line of the results table. `interval` is the paired median and its bounds in `unit` (or a ratio);
    rows measured once (sizes, counts) have none."""

    measure: str
    fntrain: str
    baseline: str
    difference: str
    goal: str
    verdict: str = "-"
    interval: Interval | None = None
    unit: str = ""
    rounds: int = 0
    note: str = ""

    @property
    def met(self) -> bool | None:
        return {"met": True, "NOT met": False}.get(self.verdict)


@dataclass(frozen=True)
class Timing:
    """Per-variant samples (seconds per unit of work), one per round, in round order: `samples` the whole
    call, `outside` the per-unit time the callable measured itself outside the step (or the whole call's
    when it measured none)."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    outside: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def paired(self, variant: str, baseline: str, *, outside: bool = False) -> list[float]:
        """variant - baseline, round by round (seconds per unit)."""
        source = self.outside if outside else self.samples
        return [v - b for v, b in zip(source[variant], source[baseline], strict=True)]

    def ratios(self, variant: str, baseline: str) -> list[float]:
        """variant / baseline, round by round."""
        return [v / b for v, b in zip(self.samples[variant], self.samples[baseline], strict=True)]


@dataclass(frozen=True)
class Target:
    """A comparison to run rounds for until its interval is narrower than `width` (seconds per unit, or a
    ratio when `ratio`)."""

    variant: str
    baseline: str
    width: float
    outside: bool = False
    ratio: bool = False

    def interval(self, timing: Timing) -> Interval:
        if self.ratio:
            return bootstrap_median(timing.ratios(self.variant, self.baseline), resamples=500)
        return bootstrap_median(timing.paired(self.variant, self.baseline, outside=self.outside), resamples=500)


def interleave(
    variants: dict[str, Callable[[], int | tuple[int, float]]],
    *,
    repeats: int,
    warmup: int = 1,
    targets: Sequence[Target] = (),
    budget_s: float = 0.0,
    max_repeats: int = 200,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Run every variant once per round, rotating the order every round so drift hits all alike.

    Each callable does its work and returns how many units (steps) it ran, or (units, seconds per unit
    it measured outside the step itself) for `Timing.outside`. At least `repeats`
    rounds run; then rounds continue while some target's interval is wider than its width, until
    `budget_s` seconds (from the first measured round) or `max_repeats` rounds are spent.

    `clock` times each call: wall time by default; `time.thread_time` (or `time.process_time`) for work
    that runs on this thread (process) only, so that time the scheduler gives to other processes on a
    loaded machine is not counted (the budget stays in wall time).
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    timing = Timing({name: [] for name in names}, {name: [] for name in names})
    started = time.perf_counter()
    round_index = 0
    while True:
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = clock()
            result = variants[name]()
            elapsed = clock() - t0
            units, outside = result if isinstance(result, tuple) else (result, None)
            timing.samples[name].append(elapsed / max(1, units))
            timing.outside[name].append(elapsed / max(1, units) if outside is None else outside)
        round_index += 1
        if round_index < repeats:
            continue
        if round_index >= max_repeats or time.perf_counter() - started >= budget_s:
            return timing
        if all(target.interval(timing).width <= target.width for target in targets):
            return timing


def _sign(value: float) -> str:
    return f"{value:+.1f}" if abs(value) < 1e4 else f"{value:+.4g}"


def overhead_row(
    measure: str,
    timing: Timing,
    variant: str,
    baseline: str,
    *,
    goal_us: float | None,
    outside: bool = False,
    note: str = "",
) -> Row:
    """Per-unit overhead of `variant` over `baseline` in microseconds: the median of the per-round paired
    differences with its bootstrap interval (`outside`: of the time outside the excluded step)."""
    source = timing.outside if outside else timing.samples
    ours, base = statistics.median(source[variant]) * 1e6, statistics.median(source[baseline]) * 1e6
    interval = bootstrap_median([d * 1e6 for d in timing.paired(variant, baseline, outside=outside)])
    result = verdict(interval, goal_us)
    note = _undecided_note(interval, goal_us, result, note)
    return Row(
        measure=measure,
        fntrain=f"{ours:.1f} us",
        baseline=f"{base:.1f} us",
        difference=f"{_sign(interval.median)} us [{_sign(interval.low)}, {_sign(interval.high)}]",
        goal="-" if goal_us is None else f"<= {goal_us:g} us",
        verdict=result,
        interval=interval,
        unit="us",
        rounds=interval.n,
        note=note,
    )


def paired_ratio_row(
    measure: str,
    timing: Timing,
    variant: str,
    baseline: str,
    *,
    goal_ratio: float | None,
    unit: str = "ms",
    scale: float = 1e3,
    higher_is_better: bool = False,
    rate: float = 0.0,
    note: str = "",
) -> Row:
    """The per-round ratio of `variant`'s time to `baseline`'s (or, `higher_is_better`, of the baseline's
    time to the variant's: a throughput ratio), median and bootstrap interval. The two medians show as
    time x `scale`, or with `rate` as `rate` / time (work per second)."""
    if higher_is_better:
        ratios = [b / v for v, b in zip(timing.samples[variant], timing.samples[baseline], strict=True)]
    else:
        ratios = timing.ratios(variant, baseline)
    interval = bootstrap_median(ratios)
    result = verdict(interval, goal_ratio, lower_is_better=not higher_is_better)
    note = _undecided_note(interval, goal_ratio, result, note)
    sign = ">=" if higher_is_better else "<="

    def shown(name: str) -> str:
        median = timing.median(name)
        return f"{rate / median if rate else median * scale:.4g} {unit}"

    return Row(
        measure=measure,
        fntrain=shown(variant),
        baseline=shown(baseline),
        difference=f"{interval.median:.3f}x [{interval.low:.3f}, {interval.high:.3f}]",
        goal="-" if goal_ratio is None else f"{sign} {goal_ratio:g}x",
        verdict=result,
        interval=interval,
        unit="x",
        rounds=interval.n,
        note=note,
    )


def ratio_row(
    measure: str,
    ours: float,
    base: float,
    *,
    unit: str,
    goal_ratio: float | None,
    lower_is_better: bool = True,
    note: str = "",
) -> Row:
    """A ratio of two single figures (sizes, counts, one-off timings): no interval."""
    ratio = ours / base if base else float("inf")
    result = "-" if goal_ratio is None else verdict(Interval(ratio, ratio, ratio, 1), goal_ratio,
                                                    lower_is_better=lower_is_better)  # fmt: skip
    sign = "<=" if lower_is_better else ">="
    return Row(
        measure=measure,
        fntrain=f"{ours:.4g} {unit}",
        baseline=f"{base:.4g} {unit}",
        difference=f"{ratio:.3f}x",
        goal="-" if goal_ratio is None else f"{sign} {goal_ratio:g}x",
        verdict=result,
        note=note,
    )


def _undecided_note(interval: Interval, goal: float | None, result: str, note: str) -> str:
    if result != "undecided" or goal is None:
        return note
    more = rounds_to_decide(interval, goal)
    say = "the median sits on the goal" if more is None else f"about {more} rounds in all would decide it"
    return f"undecided after {interval.n} rounds: {say}. {note}".strip()


def format_table(rows: Sequence[Row]) -> str:
    header = "| measure | fntrain | baseline | paired difference, median [95% CI] | goal | verdict | rounds |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row.measure} | {row.fntrain} | {row.baseline} | {row.difference} | {row.goal} | {row.verdict} "
            f"| {row.rounds or '-'} |"
        )
    return "\n".join(lines)


def machine_info() -> dict:
    """What the figures depend on: the machine, torch and its thread settings."""
    import torch

    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine() -> str:
    info = machine_info()
    return (
        f"{info['machine']}, {info['cpu_count']} cores, Python {info['python']}, torch {info['torch']}, "
        f"torch threads {info['torch_threads']}"
    )


def row_record(row: Row) -> dict:
    record = asdict(row)
    record["met"] = row.met
    return record


def write_json(path: str | Path, rows: Sequence[Row], **extra) -> None:
    """The rows (every interval in full) and the machine, for comparing runs with a script."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    payload = {"time": stamp, "machine": machine_info(), **extra, "rows": [row_record(row) for row in rows]}
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def append_results(title: str, rows: Sequence[Row], *, notes: Sequence[str] = (), path: Path = RESULTS) -> None:
    """Append a dated section with the table and one sentence per row on what limits it."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    parts = [f"\n## {title} ({stamp})\n", f"Machine: {machine()}\n", format_table(rows), ""]
    parts += [f"- **{row.measure}**: {row.note}" for row in rows if row.note]
    parts += [f"- {note}" for note in notes]
    with path.open("a") as handle:
        handle.write("\n".join(parts) + "\n")


def quiet() -> None:
    """No log lines, warnings or progress bars from the measured code into the table."""
    import logging

    for name in ("fntrain", "lightning", "lightning.pytorch", "lightning.fabric", "transformers", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)


def bench_main(run: Callable[[bool], Sequence[Row]], title: str, description: str | None) -> None:
    """The command line of one benchmark module: `--quick` (few repeats), `--record` (append to
    bench/RESULTS.md) and `--json FILE`; prints the table."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="few steps and repeats (CI: checks the harness)")
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    parser.add_argument("--json", default="", help="also write the rows and the machine as JSON to this file")
    args = parser.parse_args()
    rows = run(args.quick)
    print(format_table(rows))
    if args.record:
        append_results(title, rows)
    if args.json:
        write_json(args.json, rows, quick=args.quick)
