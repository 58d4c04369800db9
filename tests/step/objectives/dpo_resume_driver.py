"""Runs recipes/dpo as `fntrain run dpo` does, with a per-step metrics recorder and an optional SIGKILL,
for tests/step/objectives/test_dpo_resume.py (one process; the kill is tests/checkpoint/resume_driver.py's).
`main(argv, "recipes.grpo")` runs another recipe module the same way (tests/step/objectives/grpo/resume_driver.py).

    python -m tests.step.objectives.dpo_resume_driver OUT_DIR KILL [recipe flags...]

KILL is `none` or `optimizer:K`: SIGKILL right after optimizer.step() of step K (inside the step:
weights updated, the schedule, the state and the metrics window not yet). Each line of
OUT_DIR/steps.jsonl is one finished step: {"step": K, name: value as float.hex(), ...} for every metric
the step returned, flushed at once so that a SIGKILL loses nothing already recorded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str], recipe_module: str = "recipes.dpo") -> None:
    out_dir, kill, recipe_args = Path(argv[0]), argv[1], argv[2:]
    point, _, at = kill.partition(":")
    kill_step = int(at) if at else -1

    import importlib

    recipe = importlib.import_module(recipe_module)
    from fntrain.cli import run_recipe
    from fntrain.cli.config_file import parse_config_cli
    from fntrain.cli.errors import reporting
    from fntrain.loop import Event
    from fntrain.run.logs import setup_console_logging
    from tests.checkpoint.resume_driver import _kill

    out_dir.mkdir(parents=True, exist_ok=True)
    steps = open(out_dir / "steps.jsonl", "a")
    current = {"step": 0}

    def recorder(event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_BEGIN:
            current["step"] = state.global_step + 1
        elif event is Event.STEP_END:
            row = {name: float(value).hex() for name, value in sorted(info.metrics.items())}
            steps.write(json.dumps({"step": state.global_step, **row}) + "\n")
            steps.flush()

    def extra_hooks(built: Any) -> list[Any]:
        """The recorder; with optimizer:K, the optimizer step that kills after step K's update."""
        if point == "optimizer":
            optimizer = built.components.optimizers[0]
            step = optimizer.step

            def killing_step(*args: Any, **kw: Any) -> Any:
                result = step(*args, **kw)
                if current["step"] == kill_step:
                    _kill()
                return result

            killing_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined] # the scheduler's wrapper is inside
            optimizer.step = killing_step
        return [recorder]

    setup_console_logging()
    spec = dataclasses.replace(recipe.spec, hooks=extra_hooks)
    reporting("fntrain run", lambda: run_recipe(spec, parse_config_cli(recipe.Config, recipe_args)))


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
