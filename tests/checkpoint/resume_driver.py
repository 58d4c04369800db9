"""Runs recipes/tiny_gpt with a loss recorder and an optional SIGKILL at a precise point (for the
kill-and-resume tests). Works alone or under torchrun (rank 0 records and kills).

    python -m tests.checkpoint.resume_driver OUT_DIR KILL [recipe flags...]

KILL is `none` or `<point>:<step>`:
  step_begin:K   at STEP_BEGIN of step K (between steps: the batch is fetched, nothing computed)
  optimizer:K    right after optimizer.step() of step K (inside a step: weights updated, the schedule
                 and the state not yet)
  dcp_finish:K   while saving step K: DCP's data files are written, its .metadata not yet (for an async
                 save this happens in the background thread)
  marker:K       while saving step K: DCP's .metadata exists, fntrain's COMPLETE marker not yet
  latest:K       while saving step K: COMPLETE written, the `latest` pointer not yet moved
  export         after training, before model.safetensors is written
  preempt:K      not a kill: SIGTERM to the last rank at STEP_BEGIN of step K (a preemption notice)

Each recorded line of OUT_DIR/losses.txt is `<global_step> <loss as float.hex()>`, flushed at once so
that a SIGKILL loses nothing already recorded. Under torchrun rank 0 kills every rank and torchrun
(their pids are in OUT_DIR/pids/), like a node failure.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any


def _kill() -> None:
    """SIGKILL this process; under torchrun first every other rank and torchrun itself (each worker runs
    in its own session, so a process-group kill would not reach them): a node failure, not one crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        for pid_file in _PIDS.glob("rank_*"):
            pid = int(pid_file.read_text())
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


_PIDS = Path(".")


def main(argv: list[str]) -> None:
    out_dir, kill, recipe_args = Path(argv[0]), argv[1], argv[2:]
    point, _, at = kill.partition(":")
    kill_step = int(at) if at else -1

    import torch.distributed.checkpoint as dcp

    import fntrain.checkpoint.saver as save_module
    import recipes.tiny_gpt as recipe
    from fntrain.cli.config_file import parse_config_cli
    from fntrain.loop import Event

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        global _PIDS
        _PIDS = out_dir / "pids"  # the test empties it before each launch
        _PIDS.mkdir(exist_ok=True)
        (_PIDS / f"rank_{rank}").write_text(str(os.getpid()))
    current = {"step": 0}  # the step being run (global_step + 1 at STEP_BEGIN)
    losses = open(out_dir / "losses.txt", "a") if rank == 0 else None

    def recorder(event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_BEGIN:
            current["step"] = state.global_step + 1
            if point == "step_begin" and current["step"] == kill_step and rank == 0:
                _kill()
            if point == "preempt" and current["step"] == kill_step and rank == world - 1:
                signal.raise_signal(signal.SIGTERM)  # one rank only: the ranks must agree on the save
        elif event is Event.STEP_END and losses is not None:
            losses.write(f"{state.global_step} {float(info.metrics['loss']).hex()}\n")
            losses.flush()

    def extra_hooks(built: Any) -> list[Any]:
        """The recorder, run just before the checkpoint hook (then only the watchdog)."""
        if point == "optimizer":
            optimizer = built.components.optimizers[0]
            step = optimizer.step

            def killing_step(*args: Any, **kw: Any) -> Any:
                result = step(*args, **kw)
                if current["step"] == kill_step and rank == 0:
                    _kill()
                return result

            killing_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined] # the scheduler's wrapper is inside
            optimizer.step = killing_step
        return [recorder]

    spec = dataclasses.replace(recipe.spec, hooks=extra_hooks)

    def at_step_dir(path: Any) -> bool:
        return Path(path).name == f"step_{kill_step}" and rank == 0

    if point == "dcp_finish":
        finish = dcp.FileSystemWriter.finish

        def killing_finish(self: Any, *args: Any, **kw: Any) -> Any:
            if at_step_dir(self.path):
                _kill()
            return finish(self, *args, **kw)

        dcp.FileSystemWriter.finish = killing_finish
    elif point in ("marker", "latest"):
        name = "write_marker" if point == "marker" else "write_latest"
        original = getattr(save_module, name)

        def killing(*args: Any, **kw: Any) -> Any:
            target = args[0] if point == "marker" else args[1]
            if at_step_dir(target):
                _kill()
            return original(*args, **kw)

        setattr(save_module, name, killing)
    elif point == "export":
        import fntrain.checkpoint as checkpoint_package

        original_export = checkpoint_package.export_safetensors

        def killing_export(*args: Any, **kw: Any) -> Any:
            if rank == 0:
                _kill()
            return original_export(*args, **kw)

        checkpoint_package.export_safetensors = killing_export

    from fntrain.run.job import run_job

    result = run_job(parse_config_cli(recipe.Config, recipe_args), spec)
    if result.exit_code:
        raise SystemExit(result.exit_code)


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
