"""Launches of the slow distributed tests through the test process's fork server (the `fork_env`
fixture, tests/helpers/fork_server.py): the recipe or worker run, torchrun's agent and every one of its workers is
a fork of a process that imported torch and fntrain once, and otherwise runs as a fresh `python -m` would
(its own process, arguments, environment, streams and exit status).

    @pytest.fixture(scope="module")
    def python(fork_env):
        return preloaded_launch.through(fork_env)

    output = preloaded_launch.run(python, 2, "recipes.tiny_gpt", *flags)   # torchrun, 2 workers

Why: on the 2-core test machine a fresh interpreter spends ~5 CPU-seconds importing torch and fntrain
before its first step, per rank and per torchrun agent: most of what a tiny run costs. The server starts
only when a slow test asks for it (a module fixture), so the fast tier never pays for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Python:
    """The launcher to run instead of `sys.executable` and the environment that sends torchrun's
    workers through it too."""

    executable: str
    env: Mapping[str, str]


def through(fork_env: Mapping[str, str]) -> Python:
    """The launches of a module through the `fork_env` fixture's server (one torch thread a command)."""
    return Python(fork_env["PYTHON_FORK"], dict(fork_env))


def command(python: Python, ranks: int, module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS`, under `torchrun --standalone --nproc_per_node=RANKS` when ranks > 1."""
    if ranks == 1:
        return [python.executable, "-m", module, *args]
    torchrun = [python.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*torchrun, "-m", module, *args]


def run(python: Python, ranks: int, module: str, *args: str, timeout: float = 300, cwd: Path = ROOT) -> str:
    """Run it (from the checkout unless `cwd`); its output (stdout then stderr). A failure shows the
    output's tail; a run not ended within `timeout` seconds fails naming it, with its processes' stacks."""
    what = f"`python -m {module} {' '.join(args)}`"[:300] + (f" under torchrun on {ranks} ranks" if ranks > 1 else "")
    result = run_to_end(command(python, ranks, module, *args), what, timeout, cwd=cwd, env=dict(python.env))
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout + result.stderr
