"""A command line as a user types it, and what it must print when it fails: one line, no traceback."""

from __future__ import annotations

import subprocess

import pytest

from fntrain.cli import dispatch


def expect_one_line(capsys, argv: list[str], needle: str, code: int = 2) -> str:
    """Run `fntrain ARGV`: it exits `code` with one line on stderr containing `needle`, no traceback."""
    with pytest.raises(SystemExit) as exited:
        dispatch(argv)
    err = capsys.readouterr().err.strip()
    assert exited.value.code == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert needle in err, err
    return err


def eval_refusal(args: list[str], capsys) -> str:
    """`fntrain eval ARGS` exits 2 with one line on stderr and no traceback; returns the line."""
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["eval", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def last_line(result: subprocess.CompletedProcess) -> str:
    """The last line a finished command wrote to stderr (what a run says last)."""
    return result.stderr.strip().splitlines()[-1]
