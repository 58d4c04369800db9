"""P6 import time: `import fntrain` (and its torch-side modules) minus `import torch`, fresh interpreters."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from bench.harness import Row

FNTRAIN = "import torch, fntrain, fntrain.step, fntrain.optim, fntrain.data.pipeline, fntrain.hooks.base"
TORCH = "import torch"


def _time(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def run(quick: bool = False) -> list[Row]:
    repeats = 3 if quick else 11
    ours, base, again = [], [], []
    for _ in range(repeats):  # interleaved
        base.append(_time(TORCH))
        ours.append(_time(FNTRAIN))
        again.append(_time(TORCH))
    added = statistics.median(ours) - statistics.median(base)
    noise = abs(statistics.median(again) - statistics.median(base))
    plain = _time("import fntrain") if quick else statistics.median(_time("import fntrain") for _ in range(5))
    return [
        Row(
            measure="P6 import time: fntrain's modules over import torch",
            fntrain=f"{statistics.median(ours):.3f} s",
            baseline=f"{statistics.median(base):.3f} s",
            difference=f"{added:+.3f} s",
            noise=f"{noise:.3f} s",
            goal="<= 0.15 s",
            met=added <= 0.15 + noise,
            note=f"bare `import fntrain` (no torch) takes {plain:.3f} s including interpreter start.",
        )
    ]
