"""`run_main`: end a launcher entry point (a recipe's or the `fntrain` command's) so that a finished
distributed run exits with its own status.

Under torchrun, interpreter finalization can abort a worker whose process group is already destroyed:
gloo's C++ worker threads may still hold tensors whose release needs the GIL while the interpreter is
being torn down, and the process dies in std::terminate ("terminate called without an active exception",
SIGABRT; see pytorch/pytorch PR #179291). torchrun then reports a run that finished as a failed worker
and, with --max-restarts, starts it again. We saw this at random on CPU/gloo workers after a clean
teardown. So a worker launched by torchrun flushes its streams and logs and ends with `os._exit`,
skipping finalization; everything the run owns (checkpoints, logs, the process group) was closed before.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["run_main", "launched_by_torchrun"]


def launched_by_torchrun(env: dict[str, str] | None = None) -> bool:
    """True in a worker process started by torchrun (torch.distributed.run)."""
    env = dict(os.environ) if env is None else env
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "WORLD_SIZE" in env)


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)  # what sys.exit("message") prints
    return 1


def run_main(main: Callable[[], Any], *, exit: Callable[[int], Any] = os._exit) -> NoReturn:
    """Call `main()` and end the process with its status: 0, a SystemExit's code (e.g. a preempted run's),
    or the traceback of any other exception (raised as usual). In a torchrun worker the process ends with
    `exit` (`os._exit`) after flushing; elsewhere with `sys.exit`."""
    try:
        result = main()
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except SystemExit as error:
        code = _exit_code(error)
    if not launched_by_torchrun():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not change the exit status
            pass
    exit(code)
    raise SystemExit(code)  # only reached when `exit` returns (tests)
