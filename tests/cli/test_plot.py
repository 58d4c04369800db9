"""Plots of a run: loss.png and throughput.png from metrics.jsonl (`python -m fntrain.cli.plot RUN_DIR`)."""

from __future__ import annotations

import json
import sys

import pytest

from fntrain.cli.plot import main, plot_run, read_metrics, series
from tests.helpers.files import relative_paths
from tests.helpers.waiting import run_to_end

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")


def sample_records():
    records = []
    for step in range(10, 101, 10):
        records.append(
            {"step": step, "epoch": 0, "loss": 5.0 - step / 50, "tokens_per_s": 1000.0 + step, "mfu": 0.3}
        )
        if step % 50 == 0:
            records.append({"step": step, "epoch": 0, "val_loss": 4.9 - step / 50, "val_ppl": 100.0})
    return records


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000


def test_plot_run_writes_loss_and_throughput_pngs(tmp_path):
    write_run(tmp_path / "run", sample_records())
    written = plot_run(tmp_path / "run")
    assert [p.name for p in written] == ["loss.png", "throughput.png"]
    for path in written:
        assert_png(path)


def test_plot_run_skips_throughput_without_rates_and_can_write_elsewhere(tmp_path):
    write_run(tmp_path / "run", [{"step": 1, "epoch": 0, "loss": 3.0}, {"step": 2, "epoch": 0, "loss": 2.0}])
    written = plot_run(tmp_path / "run", out_dir=tmp_path / "plots")
    assert written == [tmp_path / "plots" / "loss.png"]
    assert_png(written[0])


def test_series_keeps_the_last_value_of_a_step_logged_twice_and_skips_bad_lines(tmp_path):
    write_run(tmp_path, [{"step": 2, "loss": 3.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 2.5}])
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write('{"step": 3, "lo')  # a line cut short by a killed run
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert series(records, "loss") == ([1, 2], [4.0, 2.5])
    assert series(records, "val_loss") == ([], [])


def test_main_prints_written_paths_and_reports_a_missing_run(tmp_path, capsys):
    write_run(tmp_path / "run", sample_records())
    assert main([str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "run" / "loss.png"),
        str(tmp_path / "run" / "throughput.png"),
    ]
    assert main([str(tmp_path / "missing")]) == 2
    assert "missing' does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "run", sample_records())
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"fntrain\[plot\]"):
        plot_run(tmp_path / "run")
    assert main([str(tmp_path / "run")]) == 2
    assert "pip install" in capsys.readouterr().err


def test_module_command_line(tmp_path, fork_env):
    write_run(tmp_path / "run", sample_records())
    result = run_to_end([fork_env["PYTHON_FORK"], "-m", "fntrain.cli.plot", str(tmp_path / "run")],
                        "`python -m fntrain.cli.plot` on a run", 120, env=fork_env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "loss.png" in result.stdout
    assert_png(tmp_path / "run" / "throughput.png")


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"step": 1, "loss": 3.0}', "not json", '{"step": 2, "loss": 2.0}'], r"metrics.jsonl' line 2: not a JSON object"),
        (['{"step": 1, "loss": 3.0}', "[1, 2]"], r"metrics.jsonl' line 2: not a JSON object"),
        (['{"step": 1, "loss": 3.0}', '{"step": 2, "lo'], r"metrics.jsonl' line 2: not a JSON object"),  # cut, then a newline
    ],
)  # fmt: skip
def test_a_malformed_metrics_file_names_its_line_and_writes_nothing(tmp_path, lines, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    before = relative_paths(tmp_path)
    with pytest.raises(ValueError, match=message):
        plot_run(run, out_dir=tmp_path / "plots")
    assert relative_paths(tmp_path) == before


def test_binary_metrics_and_missing_runs_are_clear_errors(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"metrics.jsonl' is not a metrics file: not UTF-8 text"):
        plot_run(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=r"run directory '.*nowhere' does not exist"):
        plot_run(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"metrics.jsonl' is a file, not a run directory"):
        plot_run(tmp_path / "run" / "metrics.jsonl")


def test_nothing_to_plot_writes_nothing_not_even_the_out_dir(tmp_path):
    write_run(tmp_path / "run", [{"step": 1, "epoch": 0, "grad_norm": 1.0}])
    assert plot_run(tmp_path / "run", out_dir=tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()
    write_run(tmp_path / "run2", sample_records())
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"output directory '.*afile' is a file"):
        plot_run(tmp_path / "run2", out_dir=tmp_path / "afile")


def test_missing_matplotlib_makes_no_out_dir(tmp_path, monkeypatch):
    write_run(tmp_path / "run", sample_records())
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError):
        plot_run(tmp_path / "run", out_dir=tmp_path / "plots")
    assert not (tmp_path / "plots").exists()


def _drawn_figures(monkeypatch) -> list:
    """The figures plot_run draws, kept for inspection."""
    from fntrain.cli import plot as plot_module

    figures = []
    make = plot_module._figure

    def keep(*args, **kwargs):
        figures.append(make(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(plot_module, "_figure", keep)
    return figures


def _legend_outside(figure, axes) -> bool:
    renderer = figure.canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    return legend.x0 >= axes.get_window_extent(renderer).x1  # right of the data area, not over it


def test_throughput_panels_are_separate_and_legends_sit_beside_the_data(tmp_path, monkeypatch):
    """[issue 27] tokens/s and TFLOP/s are proportional: on twin axes they overlapped exactly, under
    the legend. One panel each (and step time), each with its median; legends beside the panels."""
    records = [{"step": s, "loss": 5.0 - s / 40 + 0.1 * (s % 3), "tokens_per_s": 1000.0 + 10 * (s % 7),
                "tflops": 0.02 + 0.0002 * (s % 7), "step_time_s": 0.5 - 0.005 * (s % 7)} for s in range(2, 82, 2)]
    records.append({"step": 40, "val_loss": 4.1})
    records.append({"step": 80, "val_loss": 3.2})
    write_run(tmp_path / "run", records)
    figures = _drawn_figures(monkeypatch)
    assert [p.name for p in plot_run(tmp_path / "run")] == ["loss.png", "throughput.png"]
    loss, throughput = figures[-2:]  # the first: plot_run making sure matplotlib is there
    panels = throughput.get_axes()
    assert [axes.get_ylabel() for axes in panels] == ["tokens/s (all ranks)", "TFLOP/s per device", "step time (s)"]
    for axes in panels:
        assert _legend_outside(throughput, axes)
        labels = [text.get_text() for text in axes.get_legend().get_texts()]
        assert any(label.startswith("median ") for label in labels) and len(axes.get_lines()) == 3  # raw, average, median
    assert "median 1.03k" in [t.get_text() for t in panels[0].get_legend().get_texts()]
    (loss_axes,) = loss.get_axes()
    assert _legend_outside(loss, loss_axes)
    labels = [text.get_text() for text in loss_axes.get_legend().get_texts()]
    assert labels == ["train loss (each log)", "train loss (moving average)", "validation loss (best 3.2, step 80)"]


def test_smoothing_and_short_numbers():
    from fntrain.cli.plot import short_number, smoothed

    assert smoothed([1.0, 2.0, 3.0, 10.0], window=3) == [1.5, 2.0, 5.0, 6.5]
    assert smoothed([4.0, 8.0]) == [4.0, 8.0]  # a window of 1 for a short series
    assert [short_number(v) for v in (21420.0, 1.25e6, 0.01712, 3.0)] == ["21.4k", "1.25M", "0.0171", "3"]
