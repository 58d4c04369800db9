"""Per-rank log files and a rank-aware console. Standard library only.

    setup_console_logging()                   # an entry point (recipe main, `fntrain run`), once
    with rank_logs(run_dir):                  # a run: <run_dir>/logs/rank_<r>.log while it lasts
        ...

- Every line of the rank log files, and of the console when several processes run (torchrun's
  `WORLD_SIZE` > 1, or a rank other than 0), starts with `[rank <r>]` (each line of a multi-line message
  and of a traceback too), so interleaved output can be told apart and grepped. A single-process
  console has no prefix.
- Console (stderr): rank 0 shows INFO and above; the other ranks only ERROR and above. Rank 0 prints
  the run's warnings once (the setting and data warnings of phases 1 and 2 are the same on every
  rank); each rank's warnings, rank 0's included, are in its log file, and an error on any rank is
  on the console. A record logged with `extra=FILE_ONLY` skips the console: a line the command prints
  itself as its last (a run's ending, `fntrain.cli.final_line.say`) is not shown twice.
- Files: `<run_dir>/logs/rank_<r>.log`, appended to (a restarted job adds to the same file, after a
  line marking the launch), INFO and above from every logger, Python warnings included once
  `setup_console_logging` routed them into logging. An exception that ends the `rank_logs` block is
  written to the file with its traceback (the console already gets it from the interpreter).

The rank comes from the launcher's `RANK` (torchrun), so logging works before the process group exists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = [
    "FORMAT",
    "FILE_ONLY",
    "RankFormatter",
    "launch_rank",
    "launch_world_size",
    "setup_console_logging",
    "rank_log_path",
    "rank_logs",
]

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
FILE_ONLY = {"fntrain_file_only": True}  # `log.info(..., extra=FILE_ONLY)`: the log files, not the console
log = logging.getLogger("fntrain.run.logs")


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher set it (`RANK`), 0 without a launcher."""
    env = os.environ if env is None else env
    try:
        return int(env.get("RANK", "0") or 0)
    except ValueError:
        return 0


def launch_world_size(env: Mapping[str, str] | None = None) -> int:
    """How many processes the launcher started (`WORLD_SIZE`), 1 without a launcher."""
    env = os.environ if env is None else env
    try:
        return max(int(env.get("WORLD_SIZE", "1") or 1), 1)
    except ValueError:
        return 1


class RankFormatter(logging.Formatter):
    """`FORMAT` with `[rank <r>] ` in front of every line of the formatted record (no prefix when
    `rank` is None)."""

    def __init__(self, rank: int | None, fmt: str = FORMAT) -> None:
        super().__init__(fmt)
        self.prefix = "" if rank is None else f"[rank {rank}] "

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.prefix:
            return text
        return "\n".join(self.prefix + line for line in text.split("\n"))


class _ConsoleHandler(logging.StreamHandler):
    """The console handler `setup_console_logging` installs (recognised when called again); it leaves
    out the records logged with `extra=FILE_ONLY`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "fntrain_file_only", False) and bool(super().filter(record))


def setup_console_logging(rank: int | None = None, *, level: int = logging.INFO) -> logging.Handler:
    """Log to stderr: rank 0 at `level`, other ranks at ERROR and above (their warnings would repeat rank
    0's: they are in each rank's log file, `rank_logs`); lines carry the rank prefix
    only when several processes run (`WORLD_SIZE` > 1 or `rank` other than 0).

    For entry points (it changes the root logger): replaces a console handler installed by an earlier
    call, sets the root level to `level`, and routes `warnings.warn` into logging (so warnings reach
    the rank's log file too). Returns the handler."""
    rank = launch_rank() if rank is None else rank
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _ConsoleHandler):
            root.removeHandler(handler)
    handler = _ConsoleHandler(sys.stderr)
    several = rank != 0 or launch_world_size() > 1
    handler.setFormatter(RankFormatter(rank if several else None))
    handler.setLevel(level if rank == 0 else max(level, logging.ERROR))
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler


def rank_log_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """`<run_dir>/logs/rank_<rank>.log`."""
    return Path(run_dir).expanduser() / "logs" / f"rank_{rank}.log"


@contextlib.contextmanager
def rank_logs(
    run_dir: str | os.PathLike, rank: int | None = None, *, level: int = logging.INFO, restart_count: int = 0
) -> Iterator[Path]:
    """Append every record at `level` and above to this rank's log file while the block runs; yield
    its path. The root logger's level is lowered to `level` for the block if it was higher, and
    restored after; the handler is removed and closed on exit, whatever happened."""
    rank = launch_rank() if rank is None else rank
    path = rank_log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(RankFormatter(rank))
    handler.setLevel(level)
    root = logging.getLogger()
    previous_level = root.level
    if previous_level == logging.NOTSET or previous_level > level:
        root.setLevel(level)
    root.addHandler(handler)
    log.info(
        "=== launch: pid %d, %s, restart %s, log %s", os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S %z"),
        restart_count, path,
    )  # fmt: skip
    try:
        yield path
    except BaseException as error:
        if not isinstance(error, SystemExit):  # a preemption's clean exit is not a failure
            record = log.makeRecord(
                log.name, logging.ERROR, __file__, 0, "run ended by %r", (error,), sys.exc_info()
            )
            handler.handle(record)  # the file only: the console gets the traceback from the interpreter
        raise
    finally:
        root.removeHandler(handler)
        handler.close()
        if root.level == level and previous_level != level:
            root.setLevel(previous_level)
