"""Runs several `fntrain run dpo` / `fntrain run kd` jobs one after another in one process, alone or
under torchrun, for tests/step/objectives/test_dpo_distributed.py: one launch (one start-up) serves every case.

    python -m tests.step.objectives.dpo_dist_worker STRATEGY ROOT CASE [CASE ...]

Each CASE is `name=<recipe>:<json list of flags>`; the job's run directory is ROOT/<name>. Under
torchrun the process group is made here, before the first job, so every job joins it (and none
destroys it): the runtime owns only a group it made itself (fntrain.runtime.process_group).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    strategy, root, cases = argv[0], Path(argv[1]), argv[2:]
    import torch.distributed as dist

    from fntrain.cli.config_file import parse_config_cli
    from fntrain.run.job import run_job

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched:
        dist.init_process_group("gloo")
    try:
        for case in cases:
            name, _, rest = case.partition("=")
            recipe_name, _, flags = rest.partition(":")
            recipe = importlib.import_module(f"recipes.{recipe_name}")
            args = [*json.loads(flags), "--run-dir", str(root / name), "--parallel.strategy", strategy]
            result = run_job(parse_config_cli(recipe.Config, args), recipe.spec)
            if result.exit_code:
                raise SystemExit(f"{name}: exit {result.exit_code}")
    finally:
        if launched:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
