"""Runs recipes/tiny_gpt as `fntrain run` does (so logging, exit codes and preemption behave as in production) with a
loss recorder and one injected fault. Test-only machinery: the library knows nothing of it. Works alone
or under torchrun.

    python -m tests.run.fault_driver OUT_DIR FAULT [recipe flags...]

FAULT is `none` or `<kind>:<rank>:<step>[:<seconds>]`:
  crash:R:K      rank R raises RuntimeError at STEP_BEGIN of step K, on the job's first launch only
                 (TORCHELASTIC_RESTART_COUNT 0), so a torchrun restart runs through
  stall:R:K:S    rank R sleeps S seconds inside step K (in optimizer.step, after the backward's collectives)
  sigterm:R:K    rank R sends itself SIGTERM at STEP_BEGIN of step K (a preemption notice), first launch only
  sigint:R:K     rank R sends itself SIGINT (Ctrl-C) at STEP_BEGIN of step K, first launch only
  nospacecheck   the free-space check before each save always passes (so that a full filesystem fails
                 inside DCP's write, as it would where free space cannot be known in advance)
  sigstop:R:K    rank R sends itself SIGSTOP at STEP_BEGIN of step K, first launch only: a frozen rank
                 (every thread stopped, its watchdog too), as a dead NFS mount or a debugger leaves it

Rank 0 appends `<global_step> <loss as float.hex()>` to OUT_DIR/losses.txt at every STEP_END, flushed
at once; OUT_DIR/exit_<rank>.txt receives the SystemExit code when the run exits through one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def stalling_step(step: Any, seconds: float, *args: Any, **kw: Any) -> Any:
    """The optimizer step of the stalled rank: a hang the watchdog must find in the stack dump."""
    time.sleep(seconds)
    return step(*args, **kw)


def main(argv: list[str]) -> None:
    out_dir, fault, recipe_args = Path(argv[0]), argv[1], argv[2:]
    parts = fault.split(":") if fault != "none" else []
    kind = parts[0] if parts else ""
    fault_rank = int(parts[1]) if len(parts) > 1 else -1
    fault_step = int(parts[2]) if len(parts) > 2 else -1
    seconds = float(parts[3]) if len(parts) > 3 else 0.0

    import recipes.tiny_gpt as recipe
    from fntrain.loop import Event

    rank = int(os.environ.get("RANK", "0"))
    first_launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    armed = rank == fault_rank and first_launch
    out_dir.mkdir(parents=True, exist_ok=True)
    losses = open(out_dir / "losses.txt", "a") if rank == 0 else None
    current = {"step": 0}

    def recorder(event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_BEGIN:
            current["step"] = state.global_step + 1
            if armed and current["step"] == fault_step:
                if kind == "crash":
                    raise RuntimeError(f"injected crash on rank {rank} at step {fault_step}")
                if kind in ("sigterm", "sigint", "sigstop"):
                    sent = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigstop": signal.SIGSTOP}[kind]
                    os.kill(os.getpid(), sent)
        elif event is Event.STEP_END and losses is not None:
            losses.write(f"{state.global_step} {float(info.metrics['loss']).hex()}\n")
            losses.flush()

    def extra_hooks(built: Any) -> list[Any]:
        """The recorder, run just before the checkpoint hook, which may stop the run."""
        if kind == "stall" and armed:
            optimizer = built.components.optimizers[0]
            step = optimizer.step

            def maybe_stall(*args: Any, **kw: Any) -> Any:
                if current["step"] == fault_step:
                    return stalling_step(step, seconds, *args, **kw)
                return step(*args, **kw)

            maybe_stall._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
            optimizer.step = maybe_stall
        return [recorder]

    if kind == "nospacecheck":
        import fntrain.checkpoint.saver as saver

        saver.room_problem = lambda root, tensors: (saver.needed_bytes(root, tensors), None, None)

    from fntrain.cli import run_recipe
    from fntrain.cli.config_file import parse_config_cli
    from fntrain.cli.errors import reporting
    from fntrain.run.logs import setup_console_logging

    setup_console_logging()
    try:
        spec = dataclasses.replace(recipe.spec, hooks=extra_hooks)
        reporting("fntrain run", lambda: run_recipe(spec, parse_config_cli(recipe.Config, recipe_args)))
    except SystemExit as exit_:
        (out_dir / f"exit_{rank}.txt").write_text(str(exit_.code))
        raise


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
