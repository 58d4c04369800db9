"""One rank of a 2-process gloo group for the 2-rank verification test: both ranks save step 2 and
step 4 of the toy run, rank 0 damages rank 1's data file of step 4, then both restore "latest" and,
afterwards, name the damaged checkpoint by path.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.checkpoint.verify_worker ROOT OUT

Writes OUT (JSON): the restored TrainState, whether the weights equal step 2's, the file rank 0
damaged, the warnings this rank logged and the explicit restore's error message.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fntrain.checkpoint import CheckpointDamagedError, restore, step_dir
from tests.checkpoint import toy


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(root: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    caught = _Warnings()
    logging.getLogger("fntrain.checkpoint").addHandler(caught)
    try:
        at_2, _ = toy.two_checkpoints(root)
        target = Path(root) / "step_4" / "__1_0.distcp"
        if rank == 0:
            blob = bytearray(target.read_bytes())
            if blob:
                blob[len(blob) // 2] ^= 0xFF  # rank 1's shard: one byte changed
            else:
                blob = bytearray(b"garbage")
            target.write_bytes(bytes(blob))
        dist.barrier()
        caught.messages.clear()
        fresh = toy.components(seed=9)
        state = restore("latest", fresh, root=root)
        same = all(torch.equal(at_2[k], v) for k, v in toy.weights(fresh).items())
        warnings = list(caught.messages)
        try:
            restore(Path(root) / "step_4.damaged", toy.components(), root=root)
            explicit = ""
        except CheckpointDamagedError as error:
            explicit = str(error)
        dist.barrier()
        Path(out).write_text(
            json.dumps(
                {
                    "restored": state.as_dict(),
                    "weights_match_step_2": same,
                    "damaged_file": target.name,
                    "warnings": warnings,
                    "explicit_error": explicit,
                    "step_4_gone": not step_dir(root, 4).exists(),
                }
            )
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(*sys.argv[1:]))
