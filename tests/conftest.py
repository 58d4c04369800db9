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

import pytest  # noqa: E402


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
