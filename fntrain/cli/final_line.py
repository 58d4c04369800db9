"""The one line a command ends with, and where it goes. Standard library only.

`say(line, exit_code)` prints the line on stderr, except in a rank started by the launcher
(`fntrain run --nproc-per-node N RECIPE ...`, `fntrain.cli.launcher`): there every rank would print
its own copy (a bad setting fails on every rank alike), so the rank writes the line, its exit status,
rank, pid and time as one JSON record into the directory the launcher names in `LINES_ENV`, and the
launcher prints the first failing rank's line once. A record that cannot be written is printed instead,
so the line is never lost. Plain `torchrun ... -m fntrain run` sets no `LINES_ENV`: its ranks print.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

__all__ = ["LINES_ENV", "say"]

LINES_ENV = "FNTRAIN_LAUNCHER_LINES"


def say(line: str, exit_code: int) -> None:
    """Show `line`, the last thing a command says before it exits with `exit_code` (see the module)."""
    directory = os.environ.get(LINES_ENV, "")
    if directory:
        rank = os.environ.get("RANK", "0")
        record = {"line": line, "exit_code": exit_code, "rank": int(rank) if rank.isdigit() else 0,
                  "pid": os.getpid(), "time": time.time(),
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}  # fmt: skip
        path = Path(directory) / f"attempt_{record['attempt']}_rank_{record['rank']}_{record['pid']}.json"
        try:
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(record))
            partial.replace(path)  # the launcher never reads half a record
            return
        except OSError:  # the launcher's directory is gone or full: the terminal still gets the line
            pass
    print(line, file=sys.stderr)
