"""The console: no rank prefix in a single process, `[rank r]` under a multi-process launch."""

from __future__ import annotations

import logging

import pytest

from fntrain.run.logs import launch_world_size, setup_console_logging


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    yield root
    for handler in list(root.handlers):
        if handler not in saved[1]:
            root.removeHandler(handler)
    root.setLevel(saved[0])
    logging.captureWarnings(False)


def record(message: str) -> logging.LogRecord:
    return logging.getLogger("fntrain.metrics").makeRecord(
        "fntrain.metrics", logging.INFO, __file__, 1, message, (), None
    )


def test_single_process_console_has_no_rank_prefix(root_logger, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    handler = setup_console_logging()
    text = handler.format(record("step=1 epoch=0 loss=2.073\nsecond"))
    assert "[rank" not in text and text.endswith("fntrain.metrics INFO step=1 epoch=0 loss=2.073\nsecond")


def test_torchrun_console_keeps_the_rank_prefix(root_logger, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert launch_world_size() == 2
    handler = setup_console_logging()
    lines = handler.format(record("a\nb")).split("\n")
    assert all(line.startswith("[rank 0] ") for line in lines)


def test_world_size_defaults_to_one():
    assert launch_world_size({}) == 1 and launch_world_size({"WORLD_SIZE": "x"}) == 1
    assert launch_world_size({"WORLD_SIZE": "4"}) == 4


def test_other_ranks_leave_warnings_to_rank_0_and_their_log_file(root_logger, monkeypatch, tmp_path, capsys):
    """Under torchrun rank 0 prints a run's warnings once; rank 1's console shows only its errors,
    while its log file still gets everything (Python warnings included)."""
    import warnings

    from fntrain.run.logs import rank_logs

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    setup_console_logging()
    with rank_logs(tmp_path, rank=1) as path:
        warnings.warn("a warning every rank raises", UserWarning, stacklevel=1)
        logging.getLogger("fntrain.run").warning("a setting warning every rank logs")
        logging.getLogger("fntrain.run").error("a failure on rank 1")
    console = capsys.readouterr().err
    assert "a warning every rank raises" not in console and "a setting warning" not in console
    assert "[rank 1] " in console and "a failure on rank 1" in console
    written = path.read_text()
    assert all(text in written for text in ("a warning every rank raises", "a setting warning", "a failure on rank 1"))


def test_a_line_the_command_ends_with_is_logged_to_the_file_only(root_logger, monkeypatch, tmp_path, capsys):
    """The summary of a run that did not finish is the command's last line (`say`): the console gets it
    once, from the command, and the log file keeps it [issue 48: the interrupt summary was printed twice]."""
    from fntrain.run.logs import FILE_ONLY, rank_logs

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    setup_console_logging()
    with rank_logs(tmp_path, rank=0) as path:
        logging.getLogger("fntrain.run.job").warning("run interrupted at step 3", extra=FILE_ONLY)
        logging.getLogger("fntrain.run.job").warning("a warning for the console")
    console = capsys.readouterr().err
    assert "run interrupted at step 3" not in console and "a warning for the console" in console
    assert "run interrupted at step 3" in path.read_text()
