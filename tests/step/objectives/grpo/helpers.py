"""Shared by the GRPO run tests (tests/step/objectives/grpo/test_distributed.py, tests/step/objectives/grpo/test_resume.py): a tiny Llama
whose completions end at several token ids, prompts, a module of deterministic reward functions written
beside them, and the preloaded launcher (tests/helpers/fork_server.py) that can import that module.

    model, prompts, modules = grpo_inputs(root)
    with started(grpo_env(modules), GRPO_PRELOAD) as launch_env: ...
    # and in the runs' flags: --grpo.reward-funcs grpo_test_rewards:plain (or :multi, :lora)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.checkpoint.test_resume import env
from tests.helpers.fork_server import DPO_PRELOAD
from tests.step.objectives.dpo_helpers import tiny_llama

GRPO_PRELOAD = (*DPO_PRELOAD, "recipes.grpo")
RECORD = "GRPO_TEST_RECORD"
"""The environment variable naming where the reward functions record what they scored (unset: nothing)."""
STOP_IDS = list(range(100, 140))  # a completion also ends at one of these (~1 in 8 draws of the tiny model)
REWARD_FUNCTIONS = ("plain", "multi", "lora")

REWARDS = f'''"""Deterministic rewards for the GRPO run tests (tests/step/objectives/grpo/helpers.py), one function per case:
each records every (step, prompt id, completion ids) it scores in ${RECORD}/<name>.rank<RANK>.jsonl."""
import json
import os


def _recording(name):
    def reward(prompts, completions, completion_ids, trainer_state, prompt_id, **columns):
        if os.environ.get("{RECORD}"):
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(os.environ["{RECORD}"], f"{{name}}.rank{{rank}}.jsonl"), "a") as file:
                for prompt, ids in zip(prompt_id, completion_ids):
                    row = {{"step": trainer_state.global_step, "prompt": prompt, "completion": list(ids)}}
                    file.write(json.dumps(row) + "\\n")
        # the share of even token ids, and a bonus for stopping early: rewards vary within each group
        return [sum(t % 2 == 0 for t in ids) / len(ids) + (len(ids) < 12) for ids in completion_ids]

    reward.__name__ = name
    return reward


{chr(10).join(f'{name} = _recording("{name}")' for name in REWARD_FUNCTIONS)}
'''


def grpo_inputs(root: Path, prompts: int = 16) -> tuple[Path, Path, Path]:
    """(model, prompts file, reward module's directory) under `root`: a tiny Llama whose generation_config
    also ends completions at STOP_IDS (so they have different lengths), `prompts` plain-text prompts with
    their index as the `prompt_id` column, and grpo_test_rewards.py (REWARDS)."""
    model = tiny_llama(root / "llama", max_positions=64)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], *STOP_IDS]
    (model / "generation_config.json").write_text(json.dumps(generation))
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What colour is thing {i}?", "prompt_id": i}) + "\n"
                            for i in range(prompts)))  # fmt: skip
    modules = root / "modules"
    modules.mkdir()
    (modules / "grpo_test_rewards.py").write_text(REWARDS)
    return model, data, modules


def grpo_env(modules: Path) -> dict[str, str]:
    """The launch environment (tests/checkpoint/test_resume.py's) with `modules` on PYTHONPATH. Start the
    fork server with it: the commands it forks (torchrun's agent and workers too) keep its sys.path."""
    launch_env = env()
    launch_env["PYTHONPATH"] = os.pathsep.join([str(modules), launch_env["PYTHONPATH"]])
    return launch_env


def is_timing(name: str) -> bool:
    """A wall-clock metric, different in every run."""
    return name.startswith("time/") or name.endswith("_per_s") or name in ("step_time_s", "tflops", "mfu")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the run exported to <run_dir>/hf_model (the model, or a LoRA adapter), keyed file:name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted((run_dir / "hf_model").glob("*.safetensors")):
        tensors.update({f"{path.name}:{key}": value for key, value in load_file(path).items()})
    return tensors
