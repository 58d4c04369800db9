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
