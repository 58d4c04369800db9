"""Plots of a run from its metrics.jsonl: `python -m fntrain.cli.plot RUN_DIR`.

Writes `loss.png` (training loss, faint per log and as a moving average, and, when present, validation
loss with its best value, against the step) and `throughput.png` (one panel each for tokens/s, MFU or
else TFLOP/s per device when known, and step time, each with its median) into the run directory (or
`--out`); legends sit beside the panels, never over the data. Needs matplotlib (the `plot` extra:
pip install 'fntrain[plot]'); without it a clear error says so. A step logged twice (a run resumed
from an earlier checkpoint) keeps its last value.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_run", "plot_command", "read_metrics", "series", "smoothed", "short_number", "main"]

_MATPLOTLIB_MISSING = "fntrain.cli.plot needs matplotlib: pip install 'fntrain[plot]' (or pip install matplotlib)"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file, in file order. Blank lines are skipped, and so is a
    last line cut short by a killed run (no newline after it); any other line that is not a JSON object
    is a `ValueError` naming the file and the line, as is a file that is not UTF-8 text."""
    records = []
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                record = _record(line)
                if record is None and line.endswith("\n"):  # only the last line can lack its newline
                    raise ValueError(f"{str(path)!r} line {number}: not a JSON object (a malformed metrics file)")
                if record is not None and "step" in record:
                    records.append(record)
    except UnicodeDecodeError:
        raise ValueError(f"{str(path)!r} is not a metrics file: not UTF-8 text") from None
    return records


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def series(records: Sequence[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name`, sorted by step; a later record for the same step wins."""
    by_step: dict[int, float] = {}
    for record in records:
        if name in record and record[name] is not None:
            by_step[int(record["step"])] = float(record[name])
    steps = sorted(by_step)
    return steps, [by_step[step] for step in steps]


def _figure(height: float = 4.5) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional (extra `plot`)
        from matplotlib.figure import Figure  # optional (extra `plot`)
    except ImportError as error:
        raise ImportError(_MATPLOTLIB_MISSING) from error
    # The object API with the Agg canvas: no pyplot, no global backend switch, no display needed.
    figure = Figure(figsize=(9, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def smoothed(values: Sequence[float], window: int | None = None) -> list[float]:
    """A centred moving average of `values` (the window: about a twentieth of them, odd, at least 1;
    shorter at the ends), the trend a noisy per-log curve hides. Written here, as numpy's convolve
    would need the same edge handling."""
    count = len(values)
    half = (window if window is not None else max(1, count // 20) | 1) // 2
    out = []
    for index in range(count):
        part = values[max(0, index - half) : index + half + 1]
        out.append(sum(part) / len(part))
    return out


def short_number(value: float) -> str:
    """3 significant digits, thousands as k and millions as M: 21.4k, 1.25M, 0.0171."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _outside_legend(axes: Any) -> None:
    """The legend beside the panel, right of the data, never over it."""
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize="small")


def _noisy_line(axes: Any, steps: list[int], values: list[float], label: str, color: str) -> None:
    """The raw values faint, their moving average bold (the raw line alone when there are few)."""
    if len(values) < 10:
        marker = "." if len(values) < 3 else None  # a point or two would not show as a line
        axes.plot(steps, values, label=label, color=color, linewidth=1.4, marker=marker)
        return
    axes.plot(steps, values, color=color, linewidth=0.8, alpha=0.35, label=f"{label} (each log)")
    axes.plot(steps, smoothed(values), color=color, linewidth=1.8, label=f"{label} (moving average)")


def _loss_plot(records: Sequence[dict[str, Any]], path: Path, run_name: str) -> bool:
    train_steps, train_loss = series(records, "loss")
    val_steps, val_loss = series(records, "val_loss")
    if not train_steps and not val_steps:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    if train_steps:
        _noisy_line(axes, train_steps, train_loss, "train loss", "tab:blue")
    if val_steps:
        best = min(range(len(val_loss)), key=val_loss.__getitem__)
        label = f"validation loss (best {val_loss[best]:.4g}, step {val_steps[best]})"
        axes.plot(val_steps, val_loss, label=label, color="tab:orange", marker="o", linewidth=1.4)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(f"loss: {run_name}")
    axes.grid(alpha=0.3)
    _outside_legend(axes)
    figure.savefig(path)
    return True


def _throughput_panels(records: Sequence[dict[str, Any]]) -> list[tuple[str, list[int], list[float], str]]:
    """(y label, steps, values, color) of each throughput panel the run logged: tokens/s, then MFU
    (when the peak is known) or else TFLOP/s per device, then step time."""
    panels = [("tokens/s (all ranks)", *series(records, "tokens_per_s"), "tab:blue")]
    mfu_steps, mfu = series(records, "mfu")
    if mfu_steps:
        panels.append(("MFU (%)", mfu_steps, [100.0 * v for v in mfu], "tab:red"))
    else:
        panels.append(("TFLOP/s per device", *series(records, "tflops"), "tab:green"))
    panels.append(("step time (s)", *series(records, "step_time_s"), "tab:purple"))
    return [panel for panel in panels if panel[1]]


def _throughput_plot(records: Sequence[dict[str, Any]], path: Path, run_name: str) -> bool:
    """One panel per figure (tokens/s and TFLOP/s are proportional: on shared axes they overlap), each
    with its median, the steady rate a user compares runs by."""
    if not series(records, "tokens_per_s")[0]:
        return False
    panels = _throughput_panels(records)
    figure = _figure(height=2.3 * len(panels) + 0.6)
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (label, steps, values, color) in zip(axes_list, panels, strict=True):
        _noisy_line(axes, steps, values, label.split(" (")[0], color)
        median = sorted(values)[len(values) // 2]
        label_text = f"median {short_number(median)}"
        axes.axhline(median, color="gray", linestyle="--", linewidth=1.0, label=label_text)
        axes.set_ylabel(label)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        _outside_legend(axes)
    axes_list[-1].set_xlabel("step")
    axes_list[0].set_title(f"throughput: {run_name}")
    figure.savefig(path)
    return True


# Each plot, its drawing function and the metrics that give it something to draw.
_PLOTS = (("loss.png", _loss_plot, ("loss", "val_loss")), ("throughput.png", _throughput_plot, ("tokens_per_s",)))


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write loss.png and throughput.png for the run in `run_dir`; return the paths written.

    A plot whose metrics the run never logged is skipped (throughput.png without tokens_per_s); with
    nothing to plot nothing is written (not even `out_dir`) and [] is returned. Everything is checked
    before a file is written: `FileNotFoundError` when `run_dir` or its metrics.jsonl is missing,
    `ValueError` for a malformed metrics file (naming the line) or an `out_dir` that is a file,
    `ImportError` when matplotlib is missing.
    """
    metrics_path = _metrics_file(run_dir)
    records = read_metrics(metrics_path)
    plots = [(name, draw) for name, draw, metrics in _PLOTS if any(series(records, m)[0] for m in metrics)]
    if not plots:
        return []
    out = Path(out_dir).expanduser() if out_dir is not None else metrics_path.parent
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {str(out_dir)!r} is a file")
    _figure()  # matplotlib missing: the ImportError now, before any directory is made
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in plots:
        draw(records, out / name, metrics_path.parent.resolve().name)
    return [out / name for name, _ in plots]


def _metrics_file(run_dir: str | Path) -> Path:
    """RUN_DIR/metrics.jsonl; errors name the run directory as given."""
    directory = Path(run_dir).expanduser()
    if not directory.exists():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if not directory.is_dir():
        raise FileNotFoundError(f"{str(run_dir)!r} is a file, not a run directory")
    if not (directory / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(run_dir)!r} (is it a run directory?)")
    return directory / "metrics.jsonl"


def plot_command(run_dir: str, out_dir: str | None = None) -> list[Path]:
    """Plot a run's metrics: loss.png (training and validation loss) and throughput.png (tokens/s, with
    MFU or TFLOP/s when logged), drawn from RUN_DIR/metrics.jsonl and written into RUN_DIR or --out-dir.
    Needs matplotlib: pip install 'fntrain[plot]'.

    Args:
        run_dir: The run directory, holding metrics.jsonl.
        out_dir: Directory for the PNG files; unset, they go into the run directory.
    """
    return plot_run(run_dir, out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fntrain.cli.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument(
        "--out", default=None, help="directory for the PNG files (default: the run directory)"
    )
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not written:
        print(
            f"nothing to plot: {args.run_dir}/metrics.jsonl has no loss or throughput records",
            file=sys.stderr,
        )
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
