"""A preloaded Python for tests that launch many short commands: a server imports torch, fntrain (and, for
the Hugging Face tests, transformers and peft) once, and stdlib launchers ask it to fork each command.
The command runs as a fresh process would: its own process (a fork), its arguments, working directory,
environment and standard streams (passed over a Unix socket), `-m MODULE` run as `__main__`, its exit
status back to the launcher (a signal as the shell reports it, 128 + N). A signal to the launcher
(torchrun stopping a worker) is passed on (SIGABRT, a test's wait running out, to the command and its
children too, which print their stacks: faulthandler is on in the server and so in every fork), and `os.getppid()` in the command names the launcher's parent
(torchrun's agent for a worker: what the resume driver kills as a node failure) until the command forks.
What a fresh process would add to its environment at import (fntrain's OMP_WAIT_POLICY, the Hub's
offline switches) is added. Without the server, or for anything but `-m MODULE`, the launcher runs the
real program.

The launchers, written by `started` into a `bin/` put first on PATH:
- `python-fork [-u] -m MODULE ARGS`: any module (a recipe, a test's driver; PYTHON_EXEC too, so that
  torchrun's workers come through it); other arguments run the real Python;
- `fntrain ARGS` and `torchrun ARGS`: the console scripts, for the doc lines.

Why: on the 2-core test machine a fresh interpreter spends ~5 CPU-seconds importing torch and fntrain
(more with transformers) before its first step, per command, per rank and per torchrun agent: most of
what a tiny run costs. Forked from one imported server, a launch pays only its own work.

    python -m tests.helpers.fork_server SOCKET [MODULE...]   # the server: preload the MODULEs, fork per connection
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

__all__ = ["started", "write_launchers", "CORE_PRELOAD", "PRELOAD", "HF_PRELOAD", "DPO_PRELOAD", "VLM_PRELOAD"]

SERVER_ENV = "FNTRAIN_FORK_SERVER"

# What the server imports (importing starts no Python thread, so nothing is lost over a fork).
# CORE_PRELOAD leaves out fntrain.run.job and fntrain.cli: the resume drivers replace functions of
# fntrain.checkpoint before they import them, as their `from ... import` must see the replacements.
CORE_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                "torch.distributed.pipelining", "torch.distributed.run", "safetensors.torch", "tyro", "fntrain",
                "fntrain.checkpoint", "fntrain.checkpoint.saver", "fntrain.cli.config_file", "fntrain.loop",
                "recipes.tiny_gpt")  # fmt: skip
# What the doc lines' commands import (the heavy ones: peft, the LLaVA and CLIP modules and mlflow take
# 5-12 s each on two shared cores); the recipes as an installed `fntrain` finds them by name
# (`fntrain_recipes`, through the entry points: a user's shell has no checkout on its import path).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.run",
           "tyro", "safetensors.torch", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.llava.modeling_llava",
           "transformers.models.clip.modeling_clip", "tokenizers", "peft", "PIL.Image", "pyarrow.parquet",
           "datasets", "matplotlib", "fntrain", "fntrain.cli", "fntrain.run.job",
           "fntrain.plan", "fntrain.checkpoint", "fntrain.models.hf", "fntrain.models.tiny_llama",
           "fntrain_recipes.tiny_gpt", "fntrain_recipes.hf_causal_lm", "fntrain_recipes.vlm", "fntrain_recipes.dpo",
           "fntrain_recipes.kd", "fntrain_recipes.grpo")  # fmt: skip
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
"""The tests' `{name}`: runs through the server at ${env} (tests/helpers/fork_server.py)."""
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
    server.connect(os.environ["{env}"])
except (KeyError, OSError):  # no server: the real program
    real = {{"module": [*flags, "-m", module], "script": ["-m", "fntrain"], "torchrun": ["-m", "torch.distributed.run"]}}
    os.execv(PYTHON, [PYTHON, *real[mode], *args])
request = json.dumps({{"mode": mode, "module": module, "unbuffered": bool(flags), "argv": args, "cwd": os.getcwd(),
                      "env": dict(os.environ), "parent": os.getppid()}}).encode()
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
def abort_tree(number, frame):  # a test's wait ran out: the command and its children print their stacks
    children = {{}}
    for entry in os.listdir("/proc"):
        try:
            children.setdefault(int(open(f"/proc/{{entry}}/stat").read().rpartition(")")[2].split()[1]), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    tree = [pid]
    for member in tree:
        tree.extend(children.get(member, ()))
    for member in reversed(tree):
        try:
            os.kill(member, signal.SIGABRT)
        except OSError:
            pass
signal.signal(signal.SIGABRT, abort_tree)
code = struct.unpack("!i", read(4))[0]
sys.exit(code if code >= 0 else 128 - code)
'''


def write_launchers(bin_dir: Path) -> Path:
    """`python-fork`, `fntrain` and `torchrun` launchers in `bin_dir`; returns `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, mode in (("python-fork", "module"), ("fntrain", "script"), ("torchrun", "torchrun")):
        path = bin_dir / name
        path.write_text(LAUNCHER.format(python=sys.executable, name=name, mode=mode, env=SERVER_ENV))
        path.chmod(0o755)
    return bin_dir


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


def _become(request: dict, fds: list[int], added_env: dict[str, str]) -> None:
    """In the forked child: take the launcher's streams, directory, environment and parent pid."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = request["unbuffered"]  # torchrun starts workers with `python -u`
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
    # The launcher's parent is the command's parent as an exec would leave it; a fork of the command
    # (a DataLoader worker, whose watchdog compares its parent's pid) sees its real parent again.
    real_getppid, parent = os.getppid, int(request["parent"])
    os.getppid = lambda: parent
    os.register_at_fork(after_in_child=lambda: setattr(os, "getppid", real_getppid))


def _run_command(request: dict) -> int:
    """Run the command as its program would (`python -m MODULE`, torchrun, the fntrain script); its exit
    status."""
    import runpy
    import warnings

    # runpy warns that a preloaded module (torch.distributed.run) is run again as __main__: meant here.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import", category=RuntimeWarning)
    code = 1
    try:
        if request["mode"] == "module":
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


def _report_ended(waiting: dict[int, socket.socket]) -> None:
    """Send each ended child's exit status (negative: the signal that ended it) to its launcher."""
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
            conn.close()


def serve(path: str, preload: Sequence[str] = CORE_PRELOAD) -> None:
    """Preload, then fork one command per connection; each connection gets the child's pid, then its
    exit status. Ends when its parent (the test) is gone."""
    before = dict(os.environ)
    for name in preload:
        with contextlib.suppress(ImportError):  # an optional extra that is not installed
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
                _become(request, fds, added_env)
                _exit(_run_command(request))
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!q", pid))
            waiting[pid] = conn
        _report_ended(waiting)


@contextlib.contextmanager
def started(env: Mapping[str, str], preload: Sequence[str] = CORE_PRELOAD) -> Iterator[dict[str, str]]:
    """A server preloaded with `preload`, started from the checkout with `env` (its thread settings are the
    commands': torch sizes its thread pool at import; SIGINT at its default, as in a terminal, whatever
    the test's). Yields `env` plus what sends commands to it: the launchers first on PATH (`fntrain`,
    `torchrun`), `python-fork` as PYTHON_FORK (a test's `python -m MODULE`) and as PYTHON_EXEC (torchrun's
    workers). Stopped after, with whatever it forked that still runs (they share its process group)."""
    root = Path(__file__).resolve().parents[2]
    place = Path(tempfile.mkdtemp(prefix="fntrain-fork-"))  # a short path: a socket's name has 108 bytes
    socket_path, errors = place / "server.sock", place / "server.err"
    bin_dir = write_launchers(place / "bin")
    with errors.open("w") as stderr:
        server = subprocess.Popen([sys.executable, "-m", "tests.helpers.fork_server", str(socket_path), *preload], cwd=root,
                                  env=dict(env), stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready", errors.read_text()[-3000:]
        python = str(bin_dir / "python-fork")
        yield {**env, "PATH": f"{bin_dir}:{env['PATH']}", "PYTHON_EXEC": python, "PYTHON_FORK": python,
               SERVER_ENV: str(socket_path)}  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=60)
        shutil.rmtree(place, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:] or CORE_PRELOAD)
