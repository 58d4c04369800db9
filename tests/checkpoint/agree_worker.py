"""One rank of a 2-process gloo group driving the checkpoint hook by hand, for the agreement tests:
each rank has its own fake clock (rank 1's always says a save is due; rank 0's says so after 60 s of
10-second steps), and rank 1 alone gets a preemption request at step 7.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.checkpoint.agree_worker ROOT OUT

Writes OUT (JSON): the step at which this rank's hook stopped the run, the `StopTraining`'s outcome and
exit code, and the steps it saved.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from fntrain import StepInfo, StopTraining, TrainState
from fntrain.checkpoint import SaveTarget
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.hooks.signals import Preemption
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig
from fntrain.runtime.runtime import Runtime
from tests.checkpoint import toy


def main(root: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        now = [0.0]
        clock = (lambda: now[0]) if rank == 0 else (lambda: now[0] + 1e6 * (1 + now[0]))
        config = CheckpointConfig(
            save_every_minutes=1.0, preempt_check_every=2, save_at_end=False, preempt_signals=("SIGUSR1",)
        )
        preemption = Preemption(config.preempt_signals)  # injected: rank 1 calls its request()
        parts = toy.components()
        hooks: list = []
        hooks.append(
            checkpoint_hook(config, SaveTarget(root, parts, hooks=lambda: hooks), Runtime(rank=rank, world_size=2, backend="gloo"), preemption=preemption, clock=clock)
        )
        hook = hooks[0]
        state, stopped, outcome, exit_code = TrainState(), None, None, None
        hook(Event.TRAIN_BEGIN, state, None)
        try:
            for _ in range(12):
                hook(Event.STEP_BEGIN, state, None)
                now[0] += 10.0
                state = state.after_step()
                if rank == 1 and state.global_step == 7:
                    preemption.request("test")
                hook(Event.STEP_END, state, StepInfo({}))
        except StopTraining as stop:
            stopped, outcome, exit_code = state.global_step, stop.outcome, stop.exit_code
        hook(Event.TRAIN_END, state, None)
        saved = sorted(int(p.name.split("_")[1]) for p in Path(root).glob("step_*"))
        Path(out).write_text(
            json.dumps({"stopped": stopped, "saved": saved, "outcome": outcome, "exit_code": exit_code})
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(*sys.argv[1:]))
