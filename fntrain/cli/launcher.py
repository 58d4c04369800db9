"""`fntrain run --nproc-per-node N [torchrun's options] RECIPE [the recipe's options]`: torchrun's elastic
agent started in this process (as torchtune's `tune run --nproc_per_node` does), with a failed or
interrupted job ending in one line and its exit status instead of the agent's traceback.

    fntrain run --nproc-per-node 2 tiny_gpt --parallel.strategy ddp
    fntrain run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host:29400 tiny_gpt ...

- The options before RECIPE are torchrun's own, parsed by torchrun's parser (`torch.distributed.run`:
  `--nproc-per-node`, `--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-backend`, `--rdzv-id`,
  `--max-restarts`, `--standalone`, ...); the ranks run `python -u -m fntrain run RECIPE ...`, exactly
  what `torchrun [options] -m fntrain run RECIPE ...` starts, so both train alike.
- The recipe's options are parsed here first: a typo is one line and exit status 2 before any rank starts.
- Each rank writes its last line to a directory the launcher made (`fntrain.cli.final_line`) instead of
  stderr; the launcher prints the first failing rank's line once (`[rank r]` in front when the ranks
  disagree) and exits with that rank's status: 2 for a bad setting, 1 for a failed run, 130 for Ctrl-C,
  143 for a preemption (SIGTERM to the agent, which passes it on to the ranks). A rank that left no line
  (killed, crashed) is reported by rank and status.
- The agent's own logging is silenced unless `LOGLEVEL` asks for it; torch's error-file and
  `ChildFailedError` report are not written (the agent is not wrapped in torch's `record`); the
  agent's own failure (a rendezvous that timed out) is one line too, its traceback on FNTRAIN_TRACEBACK=1.

We call torch's `torch.distributed.run.run` rather than writing an agent: its rendezvous, restarts and
signal forwarding are torchrun's, and only the ending is ours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fntrain.cli.errors import UsageError
from fntrain.cli.final_line import LINES_ENV
from fntrain.cli.usage import HELP

__all__ = ["Ending", "is_launch", "split_launch", "launch", "ending", "read_lines"]

# torchrun options that would start something other than `python -m fntrain run RECIPE`.
_NOT_HERE = ("module", "no_python", "run_path")


@dataclass(frozen=True)
class Ending:
    """How a launched job ended: the one line to print (None: nothing to say) and the exit status."""

    line: str | None
    exit_code: int


def _parser() -> argparse.ArgumentParser:
    """torchrun's own parser, its errors raised as `UsageError` instead of printing its usage."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> None:
        if "training_script" in message:
            raise UsageError("needs a RECIPE after torchrun's options (`fntrain recipes` lists them)")
        raise UsageError(f"{message} (torchrun's options come before RECIPE, the recipe's after it)")

    parser.error = error  # type: ignore[method-assign]
    return parser


def is_launch(args: Sequence[str]) -> bool:
    """Whether `fntrain run ARGS` starts with one of torchrun's options (the launcher) rather than RECIPE."""
    if not args or not args[0].startswith("-") or args[0] in HELP:
        return False
    return args[0].split("=", 1)[0] in _parser()._option_string_actions


def split_launch(args: Sequence[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """(torchrun's options, RECIPE, the recipe's arguments) of `fntrain run ARGS`; a `UsageError` for an
    option torchrun does not know, a missing RECIPE, or an option that would start another program."""
    options = _parser().parse_args(list(args))
    for name in _NOT_HERE:
        if getattr(options, name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} is not for fntrain run: its ranks run `python -m fntrain run RECIPE`")
    recipe, rest = options.training_script, list(options.training_script_args)
    if recipe.startswith("-"):
        raise UsageError(f"unknown launcher option {recipe} (torchrun's options come before RECIPE)")
    _check_nproc_per_node(options.nproc_per_node)
    return options, recipe, rest


def _check_nproc_per_node(value: str) -> None:
    """--nproc-per-node as torchrun reads it (a positive count, or cpu / gpu / xpu / auto), checked before
    the agent starts: a bad one is a `UsageError` naming it, not the agent's failure."""
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(value)
    except ValueError as error:
        reason = "" if "Unsupported" in str(error) else f" ({error})"  # cuda asked of a machine without it
        raise UsageError(f"--nproc-per-node must be a positive integer, or cpu, gpu or auto, got {value!r}{reason}") from None
    if count < 1:
        raise UsageError(f"--nproc-per-node must be a positive integer, or cpu, gpu or auto, got {value!r}")


def launch(options: argparse.Namespace, recipe_args: Sequence[str]) -> Ending:
    """Run `python -u -m fntrain run RECIPE_ARGS...` on the ranks torchrun's `options` describe, with the
    agent in this process, and say how it ended (see the module docstring)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    options.module, options.training_script = True, "fntrain"
    options.training_script_args = ["run", *recipe_args]
    lines = Path(tempfile.mkdtemp(prefix="fntrain-launch-"))
    try:
        with _quiet_agent(), _signals_restored(), _environ(LINES_ENV, str(lines)):
            torchrun.run(options)
        return Ending(None, 0)
    except ChildFailedError as failed:
        return ending(read_lines(lines), failures=failed.failures)
    except SignalException as stopped:  # the agent passed the signal on and waited for the ranks
        return ending(read_lines(lines), signal_number=int(stopped.sigval))
    except Exception as error:  # noqa: BLE001 - the agent's own failure (a rendezvous that timed out, a bad endpoint)
        if os.environ.get("FNTRAIN_TRACEBACK", "") not in ("", "0"):
            traceback.print_exception(type(error), error, error.__traceback__)
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Ending(f"fntrain run: torchrun's agent failed: {type(error).__name__}: {text}".rstrip(": "), 1)
    finally:
        shutil.rmtree(lines, ignore_errors=True)


def read_lines(directory: Path) -> list[dict[str, Any]]:
    """The ranks' records (`fntrain.cli.final_line`), unreadable ones skipped."""
    records = []
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return records


def ending(records: list[dict[str, Any]], *, failures: Mapping[int, Any] | None = None,
           signal_number: int | None = None) -> Ending:  # fmt: skip
    """The line and status of a job that failed (`failures`: torch's `ChildFailedError.failures`, global
    rank -> `ProcessFailure`) or that the agent stopped on `signal_number`, from the ranks' `records`:
    the earliest line of the failed processes (of the last attempt, when the agent only saw a signal);
    without one, the first failure's rank and status."""
    if failures is not None:
        pids = {failure.pid for failure in failures.values()}
        records = [record for record in records if record.get("pid") in pids]
    elif records:
        last = max(record.get("attempt", 0) for record in records)
        records = [record for record in records if record.get("attempt", 0) == last]
    records = [record for record in records if record.get("exit_code")]
    if records:
        first = min(records, key=lambda record: record.get("time", 0.0))
        # Every failed process said the same: the line alone; else (different lines, or some stopped
        # before they could say anything) whose line it is. A bad setting (status 2) is every rank's
        # (they share the settings), so the ranks that spoke agreeing is enough for it.
        bad_setting = int(first["exit_code"]) == 2
        said_by_all = failures is None or len(records) == len(failures) or bad_setting
        same = said_by_all and len({record["line"] for record in records}) == 1
        line = first["line"] if same else f"[rank {first.get('rank', '?')}] {first['line']}"
        return Ending(line, int(first["exit_code"]))
    if failures:
        rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        if failure.exitcode < 0:
            name = failure.signal_name()
            return Ending(
                f"fntrain run: rank {rank} was killed by {name}; its output is above", 128 - failure.exitcode
            )
        return Ending(f"fntrain run: rank {rank} exited with status {failure.exitcode}; its output is above",
                      failure.exitcode)  # fmt: skip
    number = signal_number or int(signal.SIGTERM)
    return Ending(f"fntrain run: stopped by {signal.Signals(number).name}", 128 + number)


# The agent's loggers; torch's own logging setup hands them to a stderr handler on "torch.distributed".
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent's log messages (settings, OMP_NUM_THREADS, workers stopped, the failed worker) dropped
    while it runs, unless LOGLEVEL asks for them: the ranks' output and the final line are what the
    user reads."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    saved = [(logger.handlers, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers, logger.propagate = [logging.NullHandler()], False
    try:
        yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
            logger.handlers, logger.propagate = handlers, propagate


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The agent installs handlers for SIGTERM, SIGINT, SIGHUP and SIGQUIT and never removes them."""
    numbers = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    previous = {number: signal.getsignal(number) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """`name=value` in this process's environment (which the ranks inherit) while the job runs."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
