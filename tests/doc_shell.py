"""Shared start-up for the doc-command test: the doc lines run through bash as written, but the `fntrain`
and `torchrun` on their PATH (and the Python torchrun starts its workers with: `PYTHON_EXEC`) are a stdlib
launcher that asks a server to fork the command from a process that has imported torch, transformers and
fntrain once. The command runs as a user's would: its own process (a fork), its arguments, working
directory, environment and standard streams (passed over a Unix socket), its exit status back to bash;
a signal to the launcher (torchrun stopping a worker) is passed on to the command. What a fresh process
would add to its environment at import (fntrain's OMP_WAIT_POLICY, the Hub's offline switches) is added.
Without the server (`FNTRAIN_DOC_SERVER` unset or gone) the launcher runs the real program.
`python-doc -m MODULE ARGS` (with or without `-u`) runs any module so (the slow tier's drivers and
torchrun workers: `tests.vlm_driver`, `tests.dpo_dist_worker`, ...); other `python-doc` arguments run
the real Python.

Why: every doc line is a new interpreter importing torch (and, for the Hugging Face lines,
transformers and peft): most of a tiny run's wall time on two shared cores, paid by ~50 lines and by
every torchrun worker. Forked from one imported server, a line pays only its own work. The slow-tier
tests that launch their own processes share it the same way (`started`: one server per test module).

    python -m tests.doc_shell SOCKET [MODULE...]   # the server: preload (PRELOAD, or the MODULEs), then fork per connection
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

__all__ = ["write_launchers", "started", "PRELOAD", "HF_PRELOAD", "DPO_PRELOAD", "VLM_PRELOAD"]

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
# What the Hugging Face recipe tests' launches import (no LLaVA, tracking or plotting modules).
HF_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
              "torch.distributed.tensor.parallel", "torch.distributed.run", "tyro", "safetensors.torch",
              "transformers", "transformers.models.llama.modeling_llama", "tokenizers", "peft", "fntrain",
              "fntrain.cli", "fntrain.run.job", "fntrain.checkpoint", "fntrain.models.hf",
              "recipes.hf_causal_lm")  # fmt: skip
DPO_PRELOAD = (*HF_PRELOAD, "recipes.dpo", "recipes.kd")
VLM_PRELOAD = (*HF_PRELOAD, "transformers.models.llava.modeling_llava", "transformers.models.clip.modeling_clip",
               "PIL.Image", "recipes.vlm")  # fmt: skip

LAUNCHER = '''#!{python} -S
"""The doc test's `{name}`: runs through the server at $FNTRAIN_DOC_SERVER (tests/doc_shell.py)."""
import json, os, signal, socket, struct, sys
PYTHON = {python!r}
args, mode = sys.argv[1:], {mode!r}
if mode == "module":  # `[-u] -m MODULE ARGS` (a torchrun worker, a test's driver); else the real Python
    flags = args[:1] if args[:1] == ["-u"] else []
    if args[len(flags) : len(flags) + 1] != ["-m"] or len(args) < len(flags) + 2:
        os.execv(PYTHON, [PYTHON, *args])
    module, args = args[len(flags) + 1], args[len(flags) + 2 :]
else:
    flags, module = [], None
try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ["FNTRAIN_DOC_SERVER"])
except (KeyError, OSError):  # no server: the real program
    real = {{"module": [*flags, "-m", module], "script": ["-m", "fntrain"], "torchrun": ["-m", "torch.distributed.run"]}}
    os.execv(PYTHON, [PYTHON, *real[mode], *args])
request = json.dumps({{"mode": mode, "module": module, "unbuffered": bool(flags), "argv": args, "cwd": os.getcwd(),
                      "env": dict(os.environ)}}).encode()
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
    unbuffered = request.get("unbuffered", False)  # torchrun starts workers with `python -u`
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
        if request["mode"] == "module":  # `python [-u] -m MODULE ARGS`, as torchrun starts a worker
            import runpy

            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
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


def serve(path: str, preload: Sequence[str] = PRELOAD) -> None:
    """Preload, then fork one command per connection; each connection gets the child's pid, then its
    exit status (negative: the signal that ended it). Ends when its parent (the test) is gone."""
    before = dict(os.environ)
    for name in preload:
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


@contextlib.contextmanager
def started(env: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> Iterator[dict[str, str]]:
    """A server preloaded with `preload`, started from the checkout with `env` (its OMP_NUM_THREADS is the
    commands': torch sizes its thread pool at import), and the environment that sends commands to it:
    the launchers first on PATH (`fntrain`, `torchrun`), `python-doc` as PYTHON_EXEC (torchrun's
    workers) and in PYTHON_DOC (a test's `python -m MODULE`). Stopped after."""
    root = Path(__file__).resolve().parents[1]
    place = Path(tempfile.mkdtemp(prefix="fntrain-doc-"))  # a short path: a socket's name has 108 bytes
    socket_path = place / "server.sock"
    bin_dir = write_launchers(place / "bin")
    server = subprocess.Popen([sys.executable, "-m", "tests.doc_shell", str(socket_path), *preload], cwd=root,
                              env=dict(env), stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready", (
            "the server did not start"
        )
        python = str(bin_dir / "python-doc")
        yield {**env, "PATH": f"{bin_dir}:{env['PATH']}", "PYTHON_EXEC": python, "PYTHON_DOC": python,
               "FNTRAIN_DOC_SERVER": str(socket_path)}  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(place, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:] or PRELOAD)
