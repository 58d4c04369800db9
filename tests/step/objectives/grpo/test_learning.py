"""GRPO learns: on a task a tiny random Llama can learn on a CPU in seconds (write many a's: the reward is
the share of the completion's characters that are "a"), the mean reward rises far above where it starts.

Measured over seeds 0-4 (40 steps, lr 1e-2, 8 completions per prompt; first three logged steps' mean
reward -> last three's): 0.018 -> 0.394, 0.011 -> 0.448, 0.020 -> 0.452, 0.022 -> 0.535, 0.015 -> 0.463.
The test asks three seeds for an end above 0.2 (half the lowest end seen) and 8x the start, margins
that float rounding between CPUs cannot close."""

from __future__ import annotations

import json
import sys

import pytest

from fntrain.cli import dispatch
from tests.step.objectives.dpo_helpers import tiny_llama

pytestmark = pytest.mark.slow

REWARD = '''
def letter_a(completions, **kwargs):
    return [c.count("a") / max(1, len(c)) for c in completions]
'''


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mean_reward_rises_well_above_its_start(tmp_path, monkeypatch, seed):
    pytest.importorskip("transformers")
    model = tiny_llama(tmp_path / "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say a {i}:"}) + "\n" for i in range(64)))
    (tmp_path / "learning_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "learning_rewards", raising=False)
    run = tmp_path / "run"
    dispatch(["run", "grpo", "--model.path", str(model), "--data.path", str(prompts), "--run-dir", str(run),
              "--grpo.reward-funcs", "learning_rewards:letter_a", "--grpo.num-generations", "8",
              "--grpo.max-completion-length", "16", "--train.train-iters", "40", "--train.global-batch-size", "32",
              "--train.micro-batch-size", "16", "--optim.lr", "1e-2", "--log-every", "1", "--seed", str(seed),
              "--progress.no-enabled", "--checkpoint.save-every", "0", "--checkpoint.no-export"])  # fmt: skip
    rewards = [json.loads(line)["reward"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > 0.2 and end > 8 * start, (start, end)
