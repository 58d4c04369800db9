"""Runs recipes/vlm with a loss recorder and an optional SIGKILL (alone or under torchrun; rank 0
records and kills), for the slow tier's 2-rank and kill-and-resume tests.

    python -m tests.recipes.vlm_driver OUT_DIR KILL [recipe flags...]

KILL is `none` or `step_begin:K` (SIGKILL at STEP_BEGIN of step K: the batch fetched, nothing computed).
Each line of OUT_DIR/losses.txt is `<global_step> <loss as float.hex()>`, flushed at once.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> None:
    out_dir, kill, recipe_args = Path(argv[0]), argv[1], argv[2:]
    point, _, at = kill.partition(":")
    kill_step = int(at) if at else -1

    import recipes.vlm as recipe
    from fntrain.cli.config_file import parse_config_cli
    from fntrain.loop import Event
    from fntrain.run.job import run_job

    rank = int(os.environ.get("RANK", "0"))
    out_dir.mkdir(parents=True, exist_ok=True)
    losses = open(out_dir / "losses.txt", "a") if rank == 0 else None

    def recorder(event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_BEGIN and point == "step_begin" and state.global_step + 1 == kill_step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif event is Event.STEP_END and losses is not None:
            losses.write(f"{state.global_step} {float(info.metrics['loss']).hex()}\n")
            losses.flush()

    spec = dataclasses.replace(recipe.spec, hooks=lambda built: [recorder])
    result = run_job(parse_config_cli(recipe.Config, recipe_args), spec)
    if result.exit_code:
        raise SystemExit(result.exit_code)


if __name__ == "__main__":
    main(sys.argv[1:])
