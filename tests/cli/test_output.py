"""What the command line prints: no BrokenPipe traceback, a user-facing `plot --help`, no help entry cut
mid-sentence by a line break in its docstring."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fntrain.cli import dispatch
from tests.helpers.waiting import run_to_end, wait_for_end


def fntrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fntrain", *args]


def test_plan_json_into_a_closed_pipe_exits_quietly(tmp_path):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write fails with EPIPE
    err = tmp_path / "stderr.txt"
    try:
        with open(err, "w") as stream:
            done = subprocess.Popen(fntrain_command("plan", "tiny_gpt", "--json"), stdout=write, stderr=stream)
            wait_for_end(done, "`fntrain plan tiny_gpt --json` into a closed pipe", 120, err.read_text)
    finally:
        os.close(write)
    stderr = err.read_text()
    assert done.returncode == 1 and "Traceback" not in stderr and "BrokenPipe" not in stderr


def test_plan_json_piped_to_head_has_no_traceback():
    command = " ".join(fntrain_command("plan", "tiny_gpt", "--json")) + " | head -1"
    done = run_to_end(["bash", "-c", command], "`fntrain plan tiny_gpt --json | head -1`", 120)
    assert done.returncode == 0 and done.stdout.strip() == "{"
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_plot_help_is_for_users(capsys):
    with pytest.raises(SystemExit):
        dispatch(["plot", "--help"])
    out = capsys.readouterr().out
    assert "usage: fntrain plot [-h] RUN_DIR [--out-dir DIR]" in out
    assert "loss.png" in out and "pip install 'fntrain[plot]'" in out
    for developer_words in ("FileNotFoundError", "ImportError", "return the paths", "`run_dir`", "STR|PATH"):
        assert developer_words not in out


def test_plot_takes_run_dir_first(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "epoch": 0, "loss": 2.0}\n{"step": 2, "epoch": 0, "loss": 1.5}\n'
    )
    written = dispatch(["plot", str(run), "--out-dir", str(tmp_path / "plots")])
    assert [path.name for path in written] == ["loss.png"]
    assert str(tmp_path / "plots" / "loss.png") in capsys.readouterr().out


def test_run_help_entries_from_library_configs_are_not_cut(capsys):
    with pytest.raises(SystemExit):
        dispatch(["run", "tiny_gpt", "--help-all"])  # tyro's full help (--help: the common flags, one line each)
    out = capsys.readouterr().out
    # a docstring's own line break shows as a help line ending short, then a line starting lower-case
    lines = [line.strip("│ ").rstrip() for line in out.splitlines()]
    library = ("--runtime.", "--parallel.", "--optim.", "--schedule.", "--memory.", "--throughput.", "--metrics.",
               "--progress.", "--evaluate.", "--gc.", "--profiler.", "--checkpoint.", "--watchdog.")  # fmt: skip
    flag = None
    for line, following in zip(lines, lines[1:], strict=False):
        if line.startswith("--"):
            flag = line
        if flag and flag.startswith(library) and line and not line.startswith("--"):
            cut = len(line) < 40 and re.match(r"^[a-z]", following or "")
            assert not cut, (flag, line, following)
    assert not re.search(r"\[S\d+", out)
