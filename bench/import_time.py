"""P6 import time: `import fntrain` (and its torch-side modules) minus `import torch`, fresh interpreters,
in CPU seconds (user + system) of the child process."""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys

from bench.harness import Row, Timing, overhead_row

FNTRAIN = "import torch, fntrain, fntrain.step, fntrain.step.optim, fntrain.data.pipeline, fntrain.hooks.base"
TORCH = "import torch"


def _time(code: str) -> float:
    """CPU seconds (user + system) of a fresh interpreter running `code`: time other processes take on a
    loaded machine is not counted, while the import's own work (reading files included) is."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(quick: bool = False) -> list[Row]:
    repeats = 3 if quick else 15
    ours, base = [], []
    for _ in range(repeats):  # interleaved: one round is one of each
        base.append(_time(TORCH))
        ours.append(_time(FNTRAIN))
    plain = _time("import fntrain") if quick else statistics.median(_time("import fntrain") for _ in range(5))
    # overhead_row reads seconds and shows microseconds: scale seconds by 1e-3 so the figures read in ms
    timing = Timing({"fntrain": [t * 1e-3 for t in ours], "torch": [t * 1e-3 for t in base]})
    row = overhead_row(
        "P6 import time: fntrain's modules over import torch (ms)", timing, "fntrain", "torch", goal_us=150,
        note=f"bare `import fntrain` (no torch) takes {plain:.3f} CPU s including interpreter start; CPU time of fresh interpreters.",
    )
    return [_in_ms(row)]


def _in_ms(row: Row) -> Row:
    """`overhead_row` labels its figures us; here they are ms (the samples were scaled by 1e3)."""
    import dataclasses

    swap = {field: getattr(row, field).replace(" us", " ms") for field in ("fntrain", "baseline", "difference", "goal")}
    return dataclasses.replace(row, unit="ms", **swap)
