"""Forks DataLoader workers (fntrain's pipeline, 2 workers) while an async checkpoint write runs, the
write amplified to hold glibc's exit-function lock most of the time, as a process's first save holds it
for an instant while it registers the destructors of C++ statics (the hang of pytorch#130610: a worker
forked then blocks in `torch.set_num_threads` at its start). Prints `ok` when every epoch was read.

    python -m tests.checkpoint.fork_during_write_worker RUN_ROOT SAVES EPOCHS_PER_SAVE

Run it in a process of its own: the write leaves thousands of C exit handlers registered, so it ends
with os._exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter

import fntrain.checkpoint.async_save as async_save
from fntrain.checkpoint.saver import SaveTarget
from fntrain.data.pipeline import batches, build_data
from fntrain.data.settings import Batching, LoaderConfig
from fntrain.state import TrainState
from tests.checkpoint import toy

LIBC = ctypes.CDLL(None)
HANDLER = ctypes.cast(LIBC.getpid, ctypes.c_void_p)  # a harmless C function to register
REGISTER = getattr(LIBC, "__cxa_atexit")  # what a C++ static's first use calls (a name a class would mangle)
HOLD_S = 0.5  # how long each write keeps registering exit handlers before it writes


class ExitHandlerRegisteringWriter(FileSystemWriter):
    """DCP's file writer that first registers C exit handlers for HOLD_S seconds (in the write thread)."""

    def write_data(self, plan, planner):
        end = time.monotonic() + HOLD_S
        while time.monotonic() < end:
            for _ in range(1000):
                REGISTER(HANDLER, None, None)
        return super().write_data(plan, planner)


def main(root: Path, saves: int, epochs_per_save: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # fntrain's line when a fork waited
    async_save.writer = lambda path, thread_count: ExitHandlerRegisteringWriter(path, thread_count=thread_count)
    parts = toy.components()
    data = build_data(list(range(16)), Batching(micro_batch_size=4, micro_batches=2), LoaderConfig(num_workers=2))
    for save in range(1, saves + 1):
        pending = async_save.save_async(SaveTarget(root, parts), TrainState(0, save, save))
        for epoch in range(epochs_per_save):
            steps = list(batches(data, epoch, 0))  # forks 2 workers while the write runs
            assert len(steps) == 2 and all(isinstance(micro, torch.Tensor) for step in steps for micro in step)
        pending.result(60)
    print("ok", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)
