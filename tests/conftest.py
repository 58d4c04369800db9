"""Threads for the test processes, set before any test module imports torch (and stacks on SIGABRT).

The slow tier runs two test files at a time on a 2-core machine (`-n 2`). Each pytest-xdist worker,
and every process it starts, then gets one torch thread, and OpenMP threads wait passively: two
workers of two spinning threads each made an in-process learning test five times slower beside a
torchrun test (47 s alone, 243 s paired). torchrun already gives its workers one thread each; this
does the same for the in-process tests and the recipes the tests launch. A value the caller set wins.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every Python the tests start prints its threads' stacks on SIGABRT: what a wait that runs out sends
# (tests/helpers/waiting.py), so that a hang fails with where each process was stuck.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
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


@pytest.fixture(scope="module")
def python(fork_env):
    """The module's launches through the fork server (tests/helpers/preloaded_launch.py): torchrun's agent
    and workers too fork from one Python that imported torch and fntrain, whose imports cost more than a
    tiny run's steps."""
    from tests.helpers import preloaded_launch

    return preloaded_launch.through(fork_env)


@pytest.fixture(scope="module")
def module_launches_forked(request, fork_env):
    """Fills the test module's `PYTHON` record (`executable`, `env`: what its launch helpers start commands
    with) with the fork server's for the module's tests, and empties it after."""
    record = request.module.PYTHON
    record.update(executable=fork_env["PYTHON_FORK"], env=dict(fork_env))
    yield
    record.clear()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The bundled corpus's first 1700 bytes: a tiny GPT run of the slow tests gets 6 steps per epoch of it, so
    12 steps cross an epoch boundary."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:1700])
    return path


@pytest.fixture(scope="module")
def tiny_llava_dir(tmp_path_factory) -> Path:
    """The tiny LLaVA of tests/helpers/vlm.py, built once per test session and process."""
    from tests.helpers.vlm import tiny_model_dir

    return tiny_model_dir(str(tmp_path_factory.getbasetemp() / "vlm_cache"))
