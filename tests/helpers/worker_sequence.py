"""Several worker runs in one torchrun launch, for the slow distributed tests:

    torchrun --nproc_per_node=4 -m tests.helpers.worker_sequence tests.models.moe_worker fsdp2 2 A.pt -- tests.models.moe_worker fsdp2 4 B.pt

Each `--`-separated part is `MODULE ARGS...`, run as `MODULE.main(ARGS)` in order, every rank taking part.
One gloo process group, set up here, serves them all: each worker's `setup_runtime` reuses a group that
exists and leaves it alone at exit, and builds its own mesh over it. Why: on the 2-core test machine a
launch's imports and group set-up (several CPU seconds per rank) cost more than a tiny model's steps, so
the layouts of one world size share a launch. The results are the same as separate launches: each run
seeds, builds its model and meshes and restores the global flags itself.
"""

from __future__ import annotations

import importlib
import sys

import torch.distributed as dist


def parts(argv: list[str]) -> list[tuple[str, list[str]]]:
    """`MODULE ARGS... -- MODULE ARGS...` -> [(module, args), ...]."""
    found: list[list[str]] = [[]]
    for word in argv:
        if word == "--":
            found.append([])
        else:
            found[-1].append(word)
    return [(part[0], part[1:]) for part in found if part]


def main(argv: list[str]) -> None:
    runs = parts(argv)
    dist.init_process_group("gloo")
    try:
        for module, args in runs:
            importlib.import_module(module).main(args)
            dist.barrier()  # the next run's set-up must not meet a rank still saving this one's results
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
