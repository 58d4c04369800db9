"""Waiting on another thread or process: without sleeping a fixed time, and never without a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds (asked every millisecond, and once more at the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return bool(condition())


# ----------------------------------------------------------------------------- a process that must end
# A test that waits for another process waits a bounded time, and a wait that runs out says what it was
# waiting for and where that process was stuck. Every Python the tests start has faulthandler on
# (PYTHONFAULTHANDLER, set by tests/conftest.py; the fork server's commands inherit it), so SIGABRT makes
# each of them print every thread's stack to its stderr before it ends. The launcher of the fork server
# passes SIGABRT on to its command and the command's own children (tests/helpers/fork_server.py).

STACKS_GRACE_S = 10.0  # how long the stuck processes get to print their stacks before they are killed


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it that is alive now, parents before children (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rpartition(")")[2].split()[1])  # the fields after the command name: state, ppid
            children.setdefault(parent, []).append(int(entry))
    tree, index = [pid], 0
    while index < len(tree):
        tree.extend(children.get(tree[index], ()))
        index += 1
    return tree


def abort_with_stacks(pid: int, grace: float = STACKS_GRACE_S) -> None:
    """SIGABRT `pid` and its descendants (each prints its threads' stacks), give them `grace` seconds to
    print and end, then SIGKILL whatever is left of them."""
    tree = process_tree(pid)
    for member in reversed(tree):  # children first: a parent that ends first would orphan them
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGABRT)
    wait_until(lambda: not any(is_alive(member) for member in tree), grace)
    for member in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def is_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_for_end(process: subprocess.Popen, what: str, timeout: float, output: Callable[[], str]) -> None:
    """Wait up to `timeout` seconds for `process` to end. When it has not: its stacks (`abort_with_stacks`),
    then an AssertionError naming `what` it was, how long it had and the tail of `output()` (read once
    the stacks are printed)."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        abort_with_stacks(process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STACKS_GRACE_S)
        raise AssertionError(
            f"{what} did not end within {timeout:.0f} s; its threads' stacks (SIGABRT) and last output:\n"
            f"{output()[-12000:]}"
        ) from None


def run_to_end(command: Sequence[str], what: str, timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, **popen)` that ends within `timeout` seconds
    or fails naming `what` (see `wait_for_end`). Output goes to temporary files, not pipes: a process left
    behind by the command (a forked worker) cannot keep the wait open by holding a pipe."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(list(command), stdout=out, stderr=err, text=True, **popen)

        def read() -> str:
            out.seek(0)
            err.seek(0)
            return out.read() + err.read()

        try:
            wait_for_end(process, what, timeout, read)
        finally:
            if process.returncode is None:
                process.kill()
                process.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(process.args, process.returncode, out.read(), err.read())


def spawn_to_end(fn: Callable[..., Any], args: tuple, nprocs: int, what: str, timeout: float) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` that ends within `timeout` seconds or fails naming
    `what`. The ranks still running print their stacks to this test's captured stderr first."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):  # raises when a rank failed
        if time.monotonic() >= deadline:
            running = [process for process in context.processes if process.is_alive()]
            for process in running:
                abort_with_stacks(process.pid)
            ranks = [context.processes.index(process) for process in running]
            raise AssertionError(
                f"{what} did not end within {timeout:.0f} s: rank(s) {ranks} still running; their threads' "
                "stacks (SIGABRT) are in this test's captured stderr"
            )
