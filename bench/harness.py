"""The benchmark harness: compared variants alternate within one process, and every comparison is a set of
per-round paired differences (variant - baseline, measured in the same round) summarised by their median
and a seeded bootstrap 95% interval.

These machines are noisy, so absolute times mean little. Pairing within a round cancels the slow drift
(another process starting, the clock changing) that moves both variants alike; the interval then says how
far the remaining round-to-round variation leaves the median uncertain. It resamples blocks of consecutive
rounds, so drift that pairing leaves (a slow patch longer than a round) widens it. Where a difference
scales with the machine's speed it is normalised by something measured in the same round: a fixed
pure-Python yardstick (`at_reference_speed`) or the step's own time (`share_row`). What one run cannot
see at all (the machine's state from one run to the next, a busy neighbour) is added from earlier runs:
each row's run-to-run spread, recorded in bench/run_to_run.json by `python -m bench.calibrate`, widens its
interval (`with_run_to_run`). A goal is "met" only when the whole interval is within it, "NOT met" only
when the whole interval is past it, and "undecided" otherwise.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "Row", "Timing", "Interval", "interleave", "bootstrap_median", "verdict", "rounds_to_decide",
    "with_run_to_run", "run_to_run_spread", "RUN_TO_RUN", "Z95",
    "overhead_row", "share_row", "ratio_row", "paired_ratio_row", "format_table", "append_results", "machine",
    "machine_info", "write_json", "one_core", "yardstick", "in_fresh_processes", "YARDSTICK", "REFERENCE_YARDSTICK_S",
]  # fmt: skip

RESULTS = Path(__file__).with_name("RESULTS.md")
RUN_TO_RUN = Path(__file__).with_name("run_to_run.json")  # written by `python -m bench.calibrate`
Z95 = 1.96  # a normal spread's 95% half-width, in standard deviations
CONFIDENCE = 0.95
RESAMPLES = 4000
SEED = 0
YARDSTICK = "yardstick"
# The yardstick's CPU time per unit on the 2-core AMD EPYC VM these figures were taken on, with nothing of
# ours beside it (median of 200 calls, December 2026): "us at reference speed" are microseconds of that.
REFERENCE_YARDSTICK_S = 0.61e-6


@dataclass(frozen=True)
class Interval:
    """The median of paired samples and its bootstrap interval, from `n` rounds; `spread`: the run-to-run
    standard deviation already added to it (0: the interval is the bootstrap's alone)."""

    median: float
    low: float
    high: float
    n: int
    spread: float = 0.0

    @property
    def width(self) -> float:
        return self.high - self.low


def bootstrap_median(
    samples: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    block: int | None = None,
    groups: Sequence[int] | None = None,
) -> Interval:
    """The median of `samples` (in round order) with a percentile-bootstrap interval; seeded, so the same
    samples always give the same interval, which always holds the median.

    Rounds measured in more than one process (`groups`: each round's process) are resampled in two stages,
    processes with replacement and then rounds within each, so what differs from one process to the next
    (memory layout, hash seeds, the machine's state) widens the interval. Rounds of one process are
    resampled as a circular block bootstrap: blocks of `block` consecutive rounds (default ceil(sqrt(n)))
    picked with replacement, so rounds that drift together move together; `block=1` is the ordinary
    bootstrap. One sample gives a zero-width interval."""
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        raise ValueError("bootstrap_median needs at least one sample, got none")
    median = float(np.median(values))
    if values.size == 1:
        return Interval(median, median, median, 1)
    rng = np.random.default_rng(seed)
    if groups is not None and len(set(groups)) > 1:
        medians = _two_stage_medians(values, np.asarray(groups), rng, resamples)
    else:
        medians = _block_medians(values, block or math.ceil(math.sqrt(values.size)), rng, resamples)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return Interval(median, min(median, float(low)), max(median, float(high)), int(values.size))


def _block_medians(values: np.ndarray, block: int, rng: np.random.Generator, resamples: int) -> np.ndarray:
    n = values.size
    length = max(1, min(n, block))
    starts = rng.integers(0, n, size=(resamples, -(-n // length)))
    indices = (starts[:, :, None] + np.arange(length)).reshape(resamples, -1)[:, :n] % n
    return np.median(values[indices], axis=1)


def _two_stage_medians(
    values: np.ndarray, groups: np.ndarray, rng: np.random.Generator, resamples: int
) -> np.ndarray:
    members = [values[groups == group] for group in np.unique(groups)]
    medians = np.empty(resamples)
    for index in range(resamples):
        picked = rng.integers(0, len(members), size=len(members))
        medians[index] = np.median(
            np.concatenate([rng.choice(members[group], size=members[group].size) for group in picked])
        )
    return medians


def verdict(interval: Interval, goal: float | None, *, lower_is_better: bool = True) -> str:
    """The goal's verdict: "met" when the whole interval is within `goal`, "NOT met" when the whole
    interval is past it, "undecided" otherwise; "-" without a goal."""
    if goal is None:
        return "-"
    if lower_is_better:
        return "met" if interval.high <= goal else ("NOT met" if interval.low > goal else "undecided")
    return "met" if interval.low >= goal else ("NOT met" if interval.high < goal else "undecided")


def rounds_to_decide(interval: Interval, goal: float) -> int | None:
    """About how many rounds in all would make an undecided interval clear `goal`, taking its bootstrap
    half-width to shrink as 1/sqrt(rounds) around the same median (its run-to-run part does not shrink);
    None when no number of rounds would: the median sits on the goal, or the run-to-run spread alone
    reaches it."""
    distance = abs(goal - interval.median)
    floor = Z95 * interval.spread
    if distance == 0 or interval.n < 2 or _run_to_run_reaches(interval, goal):
        return None
    # The interval may be lopsided: the side facing the goal is the one that has to shrink.
    reach = interval.high - interval.median if goal > interval.median else interval.median - interval.low
    if reach <= distance:
        return interval.n
    statistical = reach**2 - floor**2  # the run-to-run part was added in quadrature (with_run_to_run)
    return math.ceil(interval.n * statistical / (distance**2 - floor**2))


def _run_to_run_reaches(interval: Interval, goal: float) -> bool:
    """Whether the interval's run-to-run part alone reaches `goal` from its median (more rounds cannot
    move the interval off the goal)."""
    return interval.median != goal and Z95 * interval.spread >= abs(goal - interval.median)


@functools.cache
def _run_to_run_spreads() -> dict[str, float]:
    if not RUN_TO_RUN.is_file():
        return {}
    return {measure: float(value) for measure, value in json.loads(RUN_TO_RUN.read_text())["spread"].items()}


def run_to_run_spread(measure: str) -> float:
    """The standard deviation of `measure`'s median between earlier runs (bench/run_to_run.json), in the
    row's unit; 0 for a row never calibrated."""
    return _run_to_run_spreads().get(measure, 0.0)


def with_run_to_run(interval: Interval, spread: float) -> Interval:
    """`interval` widened by a run-to-run standard deviation `spread`: each side's half-width and Z95 *
    spread are added in quadrature (independent sources of error), around the same median."""
    if spread <= 0:
        return interval
    extra = Z95 * spread
    low = interval.median - math.hypot(interval.median - interval.low, extra)
    high = interval.median + math.hypot(interval.high - interval.median, extra)
    return Interval(interval.median, low, high, interval.n, spread)


def _intervals(
    measure: str, values: Sequence[float], timing: Timing, spread: float | None
) -> tuple[Interval, Interval]:
    """(within the run, final): the bootstrap interval of per-round `values`, and the same with the row's
    run-to-run spread added (`spread`, or the one recorded for `measure`)."""
    within = timing.interval(values)
    return within, with_run_to_run(within, run_to_run_spread(measure) if spread is None else spread)


@dataclass(frozen=True)
class Row:
    """One line of the results table. `interval` is the paired median and its bounds in `unit` (or a ratio),
    the run-to-run spread included; `within_run` the same from this run's rounds alone. Rows measured once
    (sizes, counts) have neither."""

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
    within_run: Interval | None = None

    @property
    def met(self) -> bool | None:
        return {"met": True, "NOT met": False}.get(self.verdict)


@dataclass(frozen=True)
class Timing:
    """Per-variant samples (seconds per unit of work), one per round, in round order: `samples` the whole
    call, `outside` the per-unit time the callable measured itself outside the step (or the whole call's
    when it measured none); `groups` the process each round ran in (empty: all in one)."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    outside: dict[str, list[float]] = field(default_factory=dict)
    groups: list[int] = field(default_factory=list)

    def interval(self, values: Sequence[float], *, resamples: int = RESAMPLES) -> Interval:
        """`bootstrap_median` of per-round `values`, resampling processes first when there are several."""
        return bootstrap_median(values, resamples=resamples, groups=self.groups or None)

    @staticmethod
    def merge(timings: Sequence[Timing]) -> Timing:
        """The rounds of several processes' timings, in order, each round labelled with its process."""
        names = list(timings[0].samples)
        return Timing(
            {name: [v for timing in timings for v in timing.samples[name]] for name in names},
            {name: [v for timing in timings for v in timing.outside[name]] for name in names},
            [index for index, timing in enumerate(timings) for _ in timing.samples[names[0]]],
        )

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def paired(self, variant: str, baseline: str, *, outside: bool = False) -> list[float]:
        """variant - baseline, round by round (seconds per unit)."""
        source = self.outside if outside else self.samples
        return [v - b for v, b in zip(source[variant], source[baseline], strict=True)]

    def ratios(self, variant: str, baseline: str) -> list[float]:
        """variant / baseline, round by round."""
        return [v / b for v, b in zip(self.samples[variant], self.samples[baseline], strict=True)]

    def at_reference_speed(self, values: Sequence[float]) -> list[float]:
        """Per-round `values` scaled by REFERENCE_YARDSTICK_S / the yardstick's time in the same round: what
        they would be on the machine where the yardstick takes its reference time (needs `interleave(...,
        with_yardstick=True)`)."""
        if YARDSTICK not in self.samples:
            raise ValueError(
                "at_reference_speed needs the yardstick's rounds (interleave with_yardstick=True)"
            )
        return [v * REFERENCE_YARDSTICK_S / y for v, y in zip(values, self.samples[YARDSTICK], strict=True)]

    def share_of(self, values: Sequence[float], step: str) -> list[float]:
        """Per-round `values` divided by variant `step`'s whole time per unit in the same round."""
        return [v / s for v, s in zip(values, self.samples[step], strict=True)]


@dataclass(frozen=True)
class Target:
    """A comparison to run rounds for until its interval is narrower than `width`: in seconds per unit (at
    reference speed when `speed`), as a share of the baseline's step when `share`, or a ratio when
    `ratio`."""

    variant: str
    baseline: str
    width: float
    outside: bool = False
    ratio: bool = False
    speed: bool = False
    share: bool = False

    def values(self, timing: Timing) -> list[float]:
        if self.ratio:
            return timing.ratios(self.variant, self.baseline)
        values = timing.paired(self.variant, self.baseline, outside=self.outside)
        if self.share:
            return timing.share_of(values, self.baseline)
        return timing.at_reference_speed(values) if self.speed else values

    def interval(self, timing: Timing) -> Interval:
        return timing.interval(self.values(timing), resamples=500)


@dataclass(frozen=True)
class _Record:
    before: int
    after: int


def yardstick(units: int = 2000) -> int:
    """A fixed piece of pure-Python work shaped like a loop's per-step bookkeeping (a small frozen record,
    a dict store and load, attribute reads), `units` times; returns `units`. Timed in every round by
    `interleave(..., with_yardstick=True)`, it says how fast this machine runs such code at that moment."""
    slots: dict[int, _Record] = {}
    total = 0
    for index in range(units):
        record = _Record(index, index + 1)
        slots[index & 31] = record
        total += slots[index & 31].after - record.before
    return units


@contextmanager
def one_core() -> Iterator[int]:
    """Pin this process to one core (the last it may use) and torch to one thread, restoring both on exit;
    yields the core. A competing process then gets the other cores rather than time slices and migrations
    of ours. Where affinity cannot be set, only the thread count changes."""
    import torch

    threads = torch.get_num_threads()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    core = max(allowed) if allowed else -1
    torch.set_num_threads(1)
    if allowed:
        os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        if allowed:
            os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)


def interleave(
    variants: dict[str, Callable[[], int | tuple[int, float]]],
    *,
    repeats: int,
    warmup: int = 1,
    targets: Sequence[Target] = (),
    budget_s: float = 0.0,
    max_repeats: int = 200,
    clock: Callable[[], float] = time.perf_counter,
    with_yardstick: bool = False,
) -> Timing:
    """Run every variant once per round, rotating the order every round so drift hits all alike.

    Each callable does its work and returns how many units (steps) it ran, or (units, seconds per unit
    it measured outside the step itself) for `Timing.outside`. At least `repeats`
    rounds run; then rounds continue while some target's interval is wider than its width, until
    `budget_s` seconds (from the first measured round) or `max_repeats` rounds are spent.

    `clock` times each call: wall time by default; `time.thread_time` (or `time.process_time`) for work
    that runs on this thread (process) only, so that time the scheduler gives to other processes on a
    loaded machine is not counted (the budget stays in wall time). `with_yardstick`: `yardstick()` runs as
    one more variant, named YARDSTICK, for `Timing.at_reference_speed`.
    """
    if with_yardstick:
        variants = {**variants, YARDSTICK: yardstick}
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


def in_fresh_processes(function: Callable[..., Timing], count: int, **kwargs) -> Timing:
    """Call module-level `function(**kwargs)`, which returns a Timing, in `count` fresh interpreters one
    after another (with this process's core affinity), and merge their rounds grouped by process; with
    `count` 1, call it here. Effects fixed for a process's life (memory layout, hash seeds) then vary between
    groups, and `Timing.interval` counts them. The children's stderr is passed through; stdout is theirs."""
    if count == 1:
        return function(**kwargs)
    module = function.__module__
    if module == "__main__":  # run as `python -m bench.NAME`: the child imports it by that name
        module = sys.modules["__main__"].__spec__.name
    code = (
        "import json, sys\n"
        f"from {module} import {function.__name__} as measure\n"
        "timing = measure(**json.loads(sys.argv[1]))\n"
        "print(json.dumps({'samples': timing.samples, 'outside': timing.outside}))\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    timings = []
    for _ in range(count):
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(kwargs)], cwd=root, stdout=subprocess.PIPE, text=True,
            check=True,
        )  # fmt: skip
        record = json.loads(done.stdout.strip().splitlines()[-1])
        timings.append(Timing(record["samples"], record["outside"]))
    return Timing.merge(timings)


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
    speed: bool = False,
    note: str = "",
    spread: float | None = None,
) -> Row:
    """Per-unit overhead of `variant` over `baseline` in microseconds: the median of the per-round paired
    differences with its bootstrap interval (`outside`: of the time outside the excluded step; `speed`: at
    reference speed, `Timing.at_reference_speed`). The two medians shown are as measured."""
    source = timing.outside if outside else timing.samples
    ours, base = statistics.median(source[variant]) * 1e6, statistics.median(source[baseline]) * 1e6
    target = Target(variant, baseline, 0.0, outside=outside, speed=speed)
    within, interval = _intervals(measure, [d * 1e6 for d in target.values(timing)], timing, spread)
    result = verdict(interval, goal_us)
    note = _undecided_note(interval, goal_us, result, note)
    unit = "us at reference speed" if speed else "us"
    return Row(
        measure=measure,
        fntrain=f"{ours:.1f} us",
        baseline=f"{base:.1f} us",
        difference=f"{_sign(interval.median)} {unit} [{_sign(interval.low)}, {_sign(interval.high)}]",
        goal="-" if goal_us is None else f"<= {goal_us:g} us",
        verdict=result,
        interval=interval,
        unit=unit,
        rounds=interval.n,
        note=note,
        within_run=within,
    )


def share_row(
    measure: str,
    timing: Timing,
    variant: str,
    baseline: str,
    *,
    goal_percent: float | None,
    outside: bool = False,
    note: str = "",
    spread: float | None = None,
) -> Row:
    """Per-unit overhead of `variant` over `baseline` as a percentage of the baseline's whole time per unit
    in the same round (its step): for costs that grow and shrink with the step's own speed. The two medians
    shown are the measured times (`outside`: outside the excluded step)."""
    source = timing.outside if outside else timing.samples
    ours, base = statistics.median(source[variant]) * 1e6, statistics.median(source[baseline]) * 1e6
    target = Target(variant, baseline, 0.0, outside=outside, share=True)
    within, interval = _intervals(measure, [share * 100 for share in target.values(timing)], timing, spread)
    result = verdict(interval, goal_percent)
    note = _undecided_note(interval, goal_percent, result, note)
    step = statistics.median(timing.samples[baseline]) * 1e6
    return Row(
        measure=measure,
        fntrain=f"{ours:.1f} us",
        baseline=f"{base:.1f} us",
        difference=f"{interval.median:+.3f}% of a {step:.4g} us step "
        f"[{interval.low:+.3f}, {interval.high:+.3f}]",
        goal="-" if goal_percent is None else f"<= {goal_percent:g}%",
        verdict=result,
        interval=interval,
        unit="% of the step",
        rounds=interval.n,
        note=note,
        within_run=within,
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
    spread: float | None = None,
) -> Row:
    """The per-round ratio of `variant`'s time to `baseline`'s (or, `higher_is_better`, of the baseline's
    time to the variant's: a throughput ratio), median and bootstrap interval. The two medians show as
    time x `scale`, or with `rate` as `rate` / time (work per second)."""
    ratios = timing.ratios(baseline, variant) if higher_is_better else timing.ratios(variant, baseline)
    within, interval = _intervals(measure, ratios, timing, spread)
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
        within_run=within,
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
    if more is not None:
        say = f"about {more} rounds in all would decide it"
    elif _run_to_run_reaches(interval, goal):
        say = (
            "the run-to-run spread alone reaches the goal, so no number of rounds decides it on this machine"
        )
    else:
        say = "the median sits on the goal"
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
        "cores_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
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


def append_results(
    title: str, rows: Sequence[Row], *, notes: Sequence[str] = (), path: Path = RESULTS
) -> None:
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


def bench_main(
    run: Callable[[bool], Sequence[Row]],
    title: str,
    description: str | None,
    worker: Callable[[str, bool], None] | None = None,
) -> None:
    """The command line of one benchmark module: `--quick` (few repeats), `--record` (append to
    bench/RESULTS.md) and `--json FILE`; prints the table. A torchrun benchmark passes `worker`:
    `--worker OUT [--quick]` is then one of its ranks, `worker(OUT, quick)`."""
    import argparse

    if worker is not None and "--worker" in sys.argv:
        # run_main ends a torchrun worker with os._exit: interpreter finalization after a gloo teardown
        # can abort a worker at random (see fntrain/runtime/process.py).
        from fntrain.runtime.process import run_main

        index = sys.argv.index("--worker")
        run_main(lambda: worker(sys.argv[index + 1], "--quick" in sys.argv))

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
