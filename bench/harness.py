"""The benchmark harness: compared variants alternate within one process, medians over repeats, and an
A/A run (the baseline against itself) reported as the noise floor.

These machines are noisy, so absolute times mean little: every figure is reported against a baseline
measured in the same run, interleaved with it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Row", "Timing", "interleave", "overhead_row", "ratio_row", "format_table", "append_results", "machine"]

RESULTS = Path(__file__).with_name("RESULTS.md")


@dataclass(frozen=True)
class Row:
    """One line of the results table."""

    measure: str
    fntrain: str
    baseline: str
    difference: str
    noise: str
    goal: str
    met: bool | None = None
    note: str = ""


@dataclass(frozen=True)
class Timing:
    """Per-variant samples (seconds per unit of work) from `interleave`; `aa` names the A/A baseline."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    aa: str | None = None

    @property
    def noise(self) -> float:
        """The A/A noise floor: |median(baseline) - median(baseline run again)|, seconds per unit."""
        if self.aa is None:
            return float("nan")
        return abs(self.median(self.aa) - self.median(f"{self.aa}/A"))

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])


def interleave(variants: dict[str, Callable[[], int]], *, repeats: int, warmup: int = 1, aa: str | None = None) -> Timing:
    """Time each variant `repeats` times, rotating the order every round so drift hits all alike.

    Each variant callable does its work and returns how many units (steps) it ran; samples are seconds
    per unit. With `aa` naming a variant, it runs twice per round (as `aa` and `aa + "/A"`), giving an
    A/A pair whose difference is the noise floor.
    """
    runs = dict(variants)
    if aa is not None:
        runs[f"{aa}/A"] = variants[aa]
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            units = runs[name]()
            samples[name].append((time.perf_counter() - t0) / max(1, units))
    return Timing(samples, aa)


def overhead_row(
    measure: str, timing: Timing, variant: str, baseline: str, *, goal_us: float | None, note: str = ""
) -> Row:
    """Per-unit overhead of `variant` over `baseline` in microseconds, with the run's A/A noise floor.

    The goal counts as met when the overhead is within the goal plus the noise floor.
    """
    ours, base = timing.median(variant) * 1e6, timing.median(baseline) * 1e6
    noise = timing.noise * 1e6
    diff = ours - base
    met = None if goal_us is None else diff <= goal_us + (noise if noise == noise else 0.0)
    return Row(
        measure=measure,
        fntrain=f"{ours:.1f} us",
        baseline=f"{base:.1f} us",
        difference=f"{diff:+.1f} us ({ours / base:.3f}x)",
        noise=f"{noise:.1f} us",
        goal="-" if goal_us is None else f"<= {goal_us:g} us",
        met=met,
        note=note,
    )


def ratio_row(
    measure: str,
    ours: float,
    base: float,
    *,
    unit: str,
    goal_ratio: float | None,
    noise: float | None = None,
    lower_is_better: bool = True,
    note: str = "",
) -> Row:
    """A ratio ours / base (lower is better unless `lower_is_better=False`)."""
    ratio = ours / base if base else float("inf")
    if goal_ratio is None:
        met = None
    else:
        met = ratio <= goal_ratio if lower_is_better else ratio >= goal_ratio
    sign = "<=" if lower_is_better else ">="
    return Row(
        measure=measure,
        fntrain=f"{ours:.4g} {unit}",
        baseline=f"{base:.4g} {unit}",
        difference=f"{ratio:.3f}x",
        noise="-" if noise is None else f"{noise:.3g} {unit}",
        goal="-" if goal_ratio is None else f"{sign} {goal_ratio:g}x",
        met=met,
        note=note,
    )


def format_table(rows: Sequence[Row]) -> str:
    header = "| measure | fntrain | baseline | difference | noise floor | goal | met |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "NO")
        lines.append(
            f"| {row.measure} | {row.fntrain} | {row.baseline} | {row.difference} | {row.noise} | {row.goal} | {met} |"
        )
    return "\n".join(lines)


def machine() -> str:
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, torch threads {torch.get_num_threads()}"
    )


def append_results(title: str, rows: Sequence[Row], *, notes: Sequence[str] = (), path: Path = RESULTS) -> None:
    """Append a dated section with the table and one sentence per row on what limits it."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    parts = [f"\n## {title} ({stamp})\n", f"Machine: {machine()}\n", format_table(rows), ""]
    parts += [f"- **{row.measure}**: {row.note}" for row in rows if row.note]
    parts += [f"- {note}" for note in notes]
    with path.open("a") as handle:
        handle.write("\n".join(parts) + "\n")


def bench_main(run: Callable[[bool], Sequence[Row]], title: str, description: str | None) -> None:
    """The command line of one benchmark module: `--quick` (few repeats) and `--record` (append to
    bench/RESULTS.md); prints the table."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="few steps and repeats (CI: checks the harness)")
    parser.add_argument("--record", action="store_true", help="append the table to bench/RESULTS.md")
    args = parser.parse_args()
    rows = run(args.quick)
    print(format_table(rows))
    if args.record:
        append_results(title, rows)
