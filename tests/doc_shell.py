"""Shared start-up for the doc-command test: the doc lines run through bash as written, but the `fntrain`
and `torchrun` on their PATH (and the Python torchrun starts its workers with: `PYTHON_EXEC`) are a stdlib
launcher that asks a server to fork the command from a process that has imported torch, transformers and
fntrain once. The command runs as a user's would: its own process (a fork), its arguments, working
directory, environment and standard streams (passed over a Unix socket), its exit status back to bash;
a signal to the launcher (torchrun stopping a worker) is passed on to the command. What a fresh process
would add to its environment at import (fntrain's OMP_WAIT_POLICY, the Hub's offline switches) is added.
Without the server (`FNTRAIN_DOC_SERVER` unset or gone) the launcher runs the real program.

Why: every doc line is a new interpreter importing torch (and, for the Hugging Face lines,
transformers and peft): most of a tiny run's wall time on two shared cores, paid by ~50 lines and by
every torchrun worker. Forked from one imported server, a line pays only its own work.

    python -m tests.doc_shell SOCKET      # the server (from the checkout): preload, then fork one command per connection
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import socket
import struct
import sys
from pathlib import Path

__all__ = ["write_launchers", "PRELOAD"]

# Imported once by the server: what the doc lines' commands import (the heavy ones: peft, the LLaVA
# and CLIP modules and mlflow take 5-12 s each on two shared cores). Importing them starts no Python
# thread, so nothing is lost over a fork.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.run",
           "tyro", "safetensors.torch", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llava.modeling_llava",
           "transformers.models.clip.modeling_clip", "tokenizers", "peft", "PIL.Image", "pyarrow.parquet",
           "datasets", "matplotlib", "fntrain", "fntrain.cli", "fntrain.run.job",
           "fntrain.plan", "fntrain.checkpoint", "fntrain.models.hf", "fntrain.models.tiny_llama",
           "recipes.tiny_gpt", "recipes.hf_causal_lm", "recipes.vlm")  # fmt: skip

LAUNCHER = '''#!{python} -S
"""The doc test's `{name}`: runs through the server at $FNTRAIN_DOC_SERVER (tests/doc_shell.py)."""
import json, os, signal, socket, struct, sys
PYTHON = {python!r}
args, mode = sys.argv[1:], {mode!r}
if mode == "module" and args[:3] != ["-u", "-m", "fntrain"]:  # not a torchrun worker of fntrain
    os.execv(PYTHON, [PYTHON, *args])
args = args[3:] if mode == "module" else args
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ["FNTRAIN_DOC_SERVER"])
except (KeyError, OSError):  # no server: the real program
    real = {{"module": ["-u", "-m", "fntrain"], "script": ["-m", "fntrain"], "torchrun": ["-m", "torch.distributed.run"]}}
    os.execv(PYTHON, [PYTHON, *real[mode], *args])
request = json.dumps({{"mode": mode, "argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
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


def write_launchers(bin_dir: Path) -> Path:
    """`fntrain`, `torchrun` and `python-doc` launchers in `bin_dir` (put it first on PATH, and
    `python-doc` in PYTHON_EXEC); returns `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, mode in (("fntrain", "script"), ("torchrun", "torchrun"), ("python-doc", "module")):
        path = bin_dir / name
        path.write_text(LAUNCHER.format(python=sys.executable, name=name, mode=mode))
        path.chmod(0o755)
    return bin_dir


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return json.loads(data), fds


def _run_command(request: dict, fds: list[int], added_env: dict[str, str]) -> int:
    """In the forked child: become the command (streams, directory, environment, argv), run it; its exit
    status (`_exit` then ends the child)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = request["mode"] == "module"  # torchrun starts workers with `python -u`
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=unbuffered or os.isatty(1),
                                  write_through=unbuffered)  # fmt: skip
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace", write_through=unbuffered)  # fmt: skip
    os.chdir(request["cwd"])
    # sys.path[0] as a fresh process has it: the working directory under `-m`, the script's directory
    sys.path[0] = os.getcwd() if request["mode"] == "module" else str(Path(sys.executable).parent)
    os.environ.clear()
    os.environ.update({**added_env, **request["env"]})
    code = 1
    try:
        if request["mode"] == "module":  # `python -u -m fntrain ARGS`, as torchrun starts a worker
            import runpy

            sys.argv = ["fntrain", *request["argv"]]
            runpy.run_module("fntrain", run_name="__main__", alter_sys=True)
            code = 0
        elif request["mode"] == "torchrun":  # torchrun's agent; its workers come back here (PYTHON_EXEC)
            from torch.distributed.run import main as torchrun

            sys.argv = ["torchrun", *request["argv"]]
            torchrun()
            code = 0
        else:  # the console script: sys.exit(main())
            from fntrain.cli.main import main

            sys.argv = ["fntrain", *request["argv"]]
            code = main()
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


def _exit(code: int) -> None:
    """End the child as an interpreter ends, less the teardown of its modules (seconds with torch and
    transformers imported, and nothing a command can see): non-daemon threads joined, atexit handlers
    run, streams flushed."""
    import atexit
    import threading

    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve(path: str) -> None:
    """Preload, then fork one command per connection; each connection gets the child's pid, then its
    exit status (negative: the signal that ended it). Ends when its parent (the test) is gone."""
    before = dict(os.environ)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
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
                _exit(_run_command(request, fds, added_env))
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
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
