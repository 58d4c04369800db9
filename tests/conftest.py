"""Threads for the test processes, set before any test module imports torch.

The slow tier runs two test files at a time on a 2-core machine (`-n 2`). Each pytest-xdist worker,
and every process it starts, then gets one torch thread, and OpenMP threads wait passively: two
workers of two spinning threads each made an in-process learning test five times slower beside a
torchrun test (47 s alone, 243 s paired). torchrun already gives its workers one thread each; this
does the same for the in-process tests and the recipes the tests launch. A value the caller set wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _root_logger_as_found():
    """Entry points called in-process (`fntrain run`, a recipe's main) set up console logging for the
    process: the root logger's level, a console handler, warnings routed into logging. Put that back
    after each test, so a later test in the same worker reads fntrain's log lines as a fresh process
    has them (fntrain's loggers at WARNING, through the root's default level)."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.fixture(scope="session")
def fork_env():
    """The environment to launch `python -m MODULE` commands with (`fork_env["PYTHON_FORK"]` in place of
    `sys.executable`, and this environment or a copy): each command is a fork of one server per test
    process that imported torch and fntrain once (tests/helpers/fork_server.py), started when a test first asks.
    Commands get one torch thread (the server's, sized at its import). A command that must start a
    fresh interpreter (what an import costs or pulls in, a hash seed) uses `sys.executable`."""
    from tests.helpers.fork_server import started

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with started(env) as launch_env:
        yield launch_env


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo default group whose collective timeout (the run's --runtime.timeout-s) is 77 s: a
    hook told of more ranks runs its multi-rank paths over it, and a group it makes can be checked for
    the run's timeout."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))  # fmt: skip
    yield
    dist.destroy_process_group()
