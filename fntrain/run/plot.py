"""Plots of a run from its metrics.jsonl: `python -m fntrain.run.plot RUN_DIR`.

Writes `loss.png` (training loss and, when present, validation loss against the step) and
`throughput.png` (tokens/s and, when known, MFU or TFLOP/s per device, against the step) into the run
directory (or `--out`). Needs matplotlib (the `plot` extra: pip install 'fntrain[plot]'); without it a
clear error says so. A step logged twice (a run resumed from an earlier checkpoint) keeps its last value.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_run", "plot_command", "read_metrics", "series", "main"]

_MATPLOTLIB_MISSING = "fntrain.run.plot needs matplotlib: pip install 'fntrain[plot]' (or pip install matplotlib)"


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


def _figure() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional (extra `plot`)
        from matplotlib.figure import Figure  # optional (extra `plot`)
    except ImportError as error:
        raise ImportError(_MATPLOTLIB_MISSING) from error
    # The object API with the Agg canvas: no pyplot, no global backend switch, no display needed.
    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _loss_plot(records: Sequence[dict[str, Any]], path: Path, run_name: str) -> bool:
    train_steps, train_loss = series(records, "loss")
    val_steps, val_loss = series(records, "val_loss")
    if not train_steps and not val_steps:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    if train_steps:
        axes.plot(train_steps, train_loss, label="train loss", linewidth=1.2)
    if val_steps:
        axes.plot(val_steps, val_loss, label="validation loss", marker="o", linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(f"loss: {run_name}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path)
    return True


def _throughput_plot(records: Sequence[dict[str, Any]], path: Path, run_name: str) -> bool:
    steps, tokens_per_s = series(records, "tokens_per_s")
    if not steps:
        return False
    figure = _figure()
    axes = figure.add_subplot()
    axes.plot(steps, tokens_per_s, label="tokens/s", color="tab:blue", linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel("tokens/s (all ranks)")
    axes.grid(alpha=0.3)
    handles = axes.get_legend_handles_labels()[0]
    for name, label, scale, color in (
        ("mfu", "MFU (%)", 100.0, "tab:red"),
        ("tflops", "TFLOP/s per device", 1.0, "tab:green"),
    ):
        other_steps, values = series(records, name)
        if other_steps:
            twin = axes.twinx()
            handles += twin.plot(
                other_steps, [v * scale for v in values], label=label, color=color, linewidth=1.2
            )
            twin.set_ylabel(label)
            break  # MFU when the peak is known, else TFLOP/s
    axes.legend(handles=handles, loc="lower right")
    axes.set_title(f"throughput: {run_name}")
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
    parser = argparse.ArgumentParser(prog="python -m fntrain.run.plot", description=__doc__.split("\n\n")[0])
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
