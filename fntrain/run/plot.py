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
    """The records of a metrics.jsonl file, in file order (blank or truncated last lines skipped)."""
    records = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


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


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write loss.png and throughput.png for the run in `run_dir`; return the paths written.

    A plot whose metrics the run never logged is skipped (throughput.png without tokens_per_s).
    `FileNotFoundError` when there is no metrics.jsonl; `ImportError` when matplotlib is missing.
    """
    run_dir = Path(run_dir).expanduser()
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(run_dir)!r}")
    records = read_metrics(metrics_path)
    out = Path(out_dir).expanduser() if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("loss.png", _loss_plot), ("throughput.png", _throughput_plot)):
        if draw(records, out / name, run_dir.resolve().name):
            written.append(out / name)
    return written


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
    except (FileNotFoundError, ImportError) as error:
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
