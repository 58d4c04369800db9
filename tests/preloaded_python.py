"""A preloaded `python -m MODULE` for slow tests that launch many short runs (the kill-and-resume tests):
a server imports torch, torch.distributed (checkpoint, FSDP, pipelining, torchrun) and fntrain once, and a
stdlib launcher (`python-pre`) asks it to fork each command. The command runs as a fresh process would:
its own process (a fork), its arguments, working directory, environment and standard streams (passed
over a Unix socket), `-m MODULE` run as `__main__`, its exit status back to the launcher (a signal as the
shell reports it, 128 + N); a signal to the launcher (torchrun stopping a worker) is passed on, and
`os.getppid()` in the command names the launcher's parent (torchrun's agent for a worker: what the
resume driver kills as a node failure) until the command forks. Put the launcher where `sys.executable`
was, and in PYTHON_EXEC so that torchrun's workers come through it too. Anything but `-m MODULE` (or no
server) runs the real interpreter.

Why: each launch of a tiny run otherwise spends ~5 CPU-seconds importing torch and fntrain before its
first step, several times a test and per rank; tests/doc_shell.py does the same for the doc lines.

    python -m tests.preloaded_python SOCKET    # the server: preload, then fork one command per connection
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PRELOAD", "preloaded"]

SERVER_ENV = "FNTRAIN_PRELOADED_PYTHON"

# What the launched commands import before their own set-up (importing starts no Python thread, so
# nothing is lost over a fork). Not fntrain.run.job nor fntrain.cli: the resume driver replaces functions
# of fntrain.checkpoint before it imports them, as their `from ... import` must see its replacements.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.run", "safetensors.torch", "tyro", "fntrain",
           "fntrain.checkpoint", "fntrain.checkpoint.saver", "fntrain.cli.config_file", "fntrain.loop",
           "recipes.tiny_gpt")  # fmt: skip

LAUNCHER = '''#!{python} -S
"""`python` for the tests: `-m MODULE` runs through the server at ${env} (tests/preloaded_python.py)."""
import json, os, signal, socket, struct, sys
PYTHON = {python!r}
args = sys.argv[1:]
unbuffered = args[:1] == ["-u"]
rest = args[1:] if unbuffered else args
if rest[:1] != ["-m"] or len(rest) < 2:
    os.execv(PYTHON, [PYTHON, *args])
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ["{env}"])
except (KeyError, OSError):  # no server: the real interpreter
    os.execv(PYTHON, [PYTHON, *args])
request = json.dumps({{"argv": rest[1:], "unbuffered": unbuffered, "cwd": os.getcwd(), "env": dict(os.environ),
                      "parent": os.getppid()}}).encode()
socket.send_fds(server, [struct.pack("!I", len(request)) + request], [0, 1, 2])
def read(size):
    data = b""
    while len(data) < size:
        chunk = server.recv(size - len(data))
        if not chunk:
            sys.exit(1)
        data += chunk
    return data
pid = struct.unpack("!q", read(8))[0]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, lambda number, frame: os.kill(pid, number))
code = struct.unpack("!i", read(4))[0]
sys.exit(code if code >= 0 else 128 - code)
'''


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A launcher's request (length-prefixed JSON) and its three standard streams."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data), fds


def _exit(code: int) -> None:
    """End the child as an interpreter ends, less the teardown of its modules (seconds with torch
    imported, and nothing a command can see): non-daemon threads joined, atexit handlers run, streams
    flushed."""
    import atexit
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run_module(request: dict, fds: list[int], added_env: dict[str, str]) -> int:
    """In the forked child: become `python [-u] -m MODULE ARGS` (streams, directory, environment, argv,
    parent pid), run it; its exit status (`_exit` then ends the child)."""
    import io
    import runpy
    import warnings

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = request["unbuffered"]
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=unbuffered,
                                  write_through=unbuffered)  # fmt: skip
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace", write_through=unbuffered)  # fmt: skip
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` has it
    os.environ.clear()
    os.environ.update({**added_env, **request["env"]})
    # The launcher's parent is the command's parent as an exec would leave it; a fork of the command
    # (a DataLoader worker, whose watchdog compares its parent's pid) sees its real parent again.
    real_getppid, parent = os.getppid, int(request["parent"])
    os.getppid = lambda: parent
    os.register_at_fork(after_in_child=lambda: setattr(os, "getppid", real_getppid))
    module, *args = request["argv"]
    # runpy warns that a preloaded module (torch.distributed.run) is run again as __main__: meant here.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import", category=RuntimeWarning)
    code = 1
    try:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
        if not isinstance(error.code, (int, type(None))):
            print(error.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does: its traceback, status 1
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return code


def serve(path: str) -> None:
    """Preload, then fork one command per connection; each connection gets the child's pid, then its
    exit status (negative: the signal that ended it). Ends when its parent (the test) is gone."""
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    added_env = {key: value for key, value in os.environ.items() if before.get(key) != value}
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _exit(_run_module(request, fds, added_env))
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!q", pid))
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                conn.close()


@contextlib.contextmanager
def preloaded(place: Path, env: dict[str, str]) -> Iterator[tuple[str, dict[str, str]]]:
    """A server started with `env` (its thread settings are the commands'; SIGINT at its default, as in a
    terminal, whatever the test's), in `place`: yields the launcher to run instead of `sys.executable` and
    the variables to add to a command's environment (they also send torchrun's workers through it).
    Stopped after, with whatever it forked that still runs (they share its process group)."""
    root = Path(__file__).resolve().parents[1]
    launcher = place / "python-pre"
    launcher.write_text(LAUNCHER.format(python=sys.executable, env=SERVER_ENV))
    launcher.chmod(0o755)
    socket_path = place / "server.sock"
    server = subprocess.Popen([sys.executable, "-m", "tests.preloaded_python", str(socket_path)], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=(place / "server.err").open("w"),
                              text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready", (
            place / "server.err"
        ).read_text()[-3000:]
        yield str(launcher), {SERVER_ENV: str(socket_path), "PYTHON_EXEC": str(launcher)}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 9)
        server.wait(timeout=60)


if __name__ == "__main__":
    serve(sys.argv[1])
