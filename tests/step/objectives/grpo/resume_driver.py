"""Runs recipes/grpo as tests/step/objectives/dpo_resume_driver.py runs recipes/dpo (a per-step metrics recorder in
OUT_DIR/steps.jsonl and an optional SIGKILL after an optimizer step), for tests/step/objectives/grpo/test_resume.py.

    python -m tests.step.objectives.grpo.resume_driver OUT_DIR KILL [recipe flags...]
"""

from __future__ import annotations

import sys

from tests.step.objectives.dpo_resume_driver import main

if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:], "recipes.grpo"))
