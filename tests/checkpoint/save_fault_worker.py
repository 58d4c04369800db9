"""One rank of a 2-process gloo group for the 2-rank save-failure test: rank 1's disk is full at one
file of a save (its JSON part, its DCP data file; sync and async), and both ranks must fail together
with the same line, no rank hung, the partial removed, then save again once there is room.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.checkpoint.save_fault_worker ROOT OUT

Writes OUT (JSON): {case: the CheckpointSaveError line this rank saw, or None} and the final checkpoints.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fntrain import TrainState
from fntrain.checkpoint import CheckpointSaveError, SaveTarget, list_checkpoints, save, save_async
from tests.checkpoint import toy
from tests.checkpoint.test_save_faults import FullDisk

CASES = {
    "json": ("sync", "*rank_1.json*", 2),
    "data": ("sync", "__1_*.distcp", 3),
    "async": ("async", "__1_*.distcp", 4),
}


def main(root: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")
    parts = toy.components()
    save(SaveTarget(root, parts), TrainState(0, 1, 1))
    seen: dict[str, str | None] = {}
    for case, (mode, pattern, step) in CASES.items():
        patch = pytest.MonkeyPatch()
        if rank == 1:
            FullDisk(patch, Path(root), pattern)
        try:
            if mode == "sync":
                save(SaveTarget(root, parts), TrainState(0, step, step))
            else:
                save_async(SaveTarget(root, parts), TrainState(0, step, step), process_group=group).result(60)
            seen[case] = None
        except CheckpointSaveError as error:
            seen[case] = error.line
        finally:
            patch.undo()
        dist.barrier()
    save(SaveTarget(root, parts), TrainState(0, 5, 5))  # room again: a save works
    dist.barrier()
    Path(out).write_text(json.dumps({"seen": seen, "complete": [p.name for p in list_checkpoints(root)],
                                     "entries": sorted(p.name for p in Path(root).iterdir())}))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(*sys.argv[1:]))  # os._exit as a launched rank: see fntrain/runtime/process.py
