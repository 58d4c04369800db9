"""The rollout and the step's rollout phase as plain calls (fntrain.step.objectives.grpo.rollout, .phase):
a tiny GPT policy over byte prompts, a reward function, no run around them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fntrain.data.prompts import PromptRow
from fntrain.data.tokens import IGNORE_INDEX
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.state import TrainState
from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.phase import rollout_phase
from fntrain.step.objectives.grpo.rewards import RewardFunction
from fntrain.step.objectives.grpo.rollout import RolloutParts, RolloutSettings, rollout
from fntrain.step.objectives.logps import token_logps

G = 4


def letter_a(completions, **kwargs):
    return [c.count("a") / max(1, len(c)) for c in completions]


def _prompts(count: int, start: int = 0) -> list[PromptRow]:
    texts = [f"say a{i}" for i in range(start, start + count)]
    return [PromptRow(start + i, text, tuple(text.encode()), {"answer": i}, f"row {start + i}") for i, text in
            enumerate(texts)]  # fmt: skip


def _policy() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(ModelConfig(context=64, n_layer=1, n_head=2, d_model=16))


def _logps(model, micro_batch):
    logits = model(micro_batch["input_ids"])
    return token_logps(logits, micro_batch["labels"], 1.0)


def rollout_parts(policy, reference=None) -> RolloutParts:
    return RolloutParts(policy, _logps, reference, lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace"),
                        (RewardFunction("t:letter_a", "letter_a", letter_a),))  # fmt: skip


def _settings(**grpo) -> RolloutSettings:
    config = GRPOConfig(reward_funcs=("t:letter_a",), num_generations=G, max_completion_length=6, **grpo)
    return RolloutSettings(config, seed=3, micro_batch_size=2, micro_batches=2, pad_id=0, eos_ids=(10,))


def test_a_generation_batch_becomes_micro_batches_of_whole_groups_with_their_advantages():
    settings = _settings()
    generation = rollout(_prompts(settings.prompts), 0, rollout_parts(_policy()), settings)
    assert len(generation.steps) == 1 and len(generation.steps[0]) == 2  # one step of GA=2 micro-batches
    rows = sorted(generation.rows)
    assert rows == list(range(settings.rows)) == list(range(4))
    for batch in generation.steps[0]:
        assert set(batch) == {"input_ids", "attention_mask", "labels", "advantages", "generation_tokens"}
        assert batch["advantages"].shape == (2,) and batch["input_ids"].shape[0] == 2
    advantages = torch.cat([batch["advantages"] for batch in generation.steps[0]])
    assert abs(float(advantages.sum())) < 1e-5  # one group of 4: centred on its mean
    trained = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in generation.steps[0])
    assert float(generation.steps[0][0]["generation_tokens"]) == trained  # dapo's normaliser: the batch's tokens
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/letter_a/mean", "completions/mean_length",
                 "completions/clipped_ratio", "time/generation_s", "time/rewards_s", "time/logprobs_s"):  # fmt: skip
        assert name in generation.metrics, name
    assert generation.tokens == sum(len(p.prompt_ids) for p in _prompts(1)) * G + sum(
        len(row.completion_ids) for row in generation.rows.values())  # fmt: skip
    assert len(generation.samples) == 4 and set(generation.samples[0]["rewards"]) == {"letter_a"}


def test_old_log_probs_are_kept_only_when_a_batch_serves_several_steps_and_the_reference_only_with_a_kl():
    policy = _policy()
    on_policy = rollout(_prompts(1), 0, rollout_parts(policy), _settings())
    assert not any("old_logps" in b or "ref_logps" in b for step in on_policy.steps for b in step)
    reused = _settings(num_iterations=2, beta=0.1)
    generation = rollout(_prompts(1), 0, rollout_parts(policy, reference=_logps), reused)
    batch = generation.steps[0][0]
    assert batch["old_logps"].shape == batch["ref_logps"].shape == (2, batch["input_ids"].shape[1] - 1)
    off = batch["labels"][:, 1:] == IGNORE_INDEX
    assert bool((batch["old_logps"][off] == 0).all())  # 0 off the loss positions: what a checkpoint keeps is all
    assert torch.equal(batch["old_logps"], batch["ref_logps"])  # the same model scored both


def test_a_rows_completion_does_not_depend_on_the_world_size():
    """Rank r of 2 decodes only its rows; each row's tokens equal the one-process rollout's."""
    policy, prompts = _policy(), _prompts(2)
    one = rollout(prompts, 5, rollout_parts(policy), _settings(steps_per_generation=4))
    ranks = {}
    for rank in range(2):
        settings = RolloutSettings(GRPOConfig(reward_funcs=("t:letter_a",), num_generations=G, max_completion_length=6,
                                              steps_per_generation=2), 3, 2, 1, rank, 2, 0, (10,))  # fmt: skip
        ranks.update(rollout(prompts, 5, rollout_parts(policy), settings).rows)
    assert sorted(ranks) == sorted(one.rows)
    assert {i: row.completion_ids for i, row in ranks.items()} == {i: row.completion_ids for i, row in one.rows.items()}


def test_the_logged_completions_are_the_batchs_first_rows_on_any_world_size():
    """samples.jsonl's completions are the generation batch's first `completions_to_log` rows, gathered
    from the ranks that sampled them, in row order: 2 ranks log what one process logs. (Their rewards
    and advantages need the ranks' all_reduce: tests/recipes/test_layout_invariance.py compares those on
    real runs.)"""
    policy, prompts = _policy(), _prompts(2)
    grpo = {"reward_funcs": ("t:letter_a",), "num_generations": G, "max_completion_length": 6, "completions_to_log": 6}
    one = rollout(prompts, 5, rollout_parts(policy),
                  RolloutSettings(GRPOConfig(**grpo, steps_per_generation=4), 3, 2, 1, 0, 1, 0, (10,)))
    shares: dict[int, list] = {}

    def gather_as(rank: int):  # rank 1 runs first: rank 0's gather then sees both shares
        def gather_objects(items):
            shares[rank] = items
            return [shares.get(0, []), shares[1]]

        return gather_objects

    logged = {}
    for rank in (1, 0):
        parts = dataclasses.replace(rollout_parts(policy), gather_objects=gather_as(rank))
        settings = RolloutSettings(GRPOConfig(**grpo, steps_per_generation=2), 3, 2, 1, rank, 2, 0, (10,))
        logged[rank] = rollout(prompts, 5, parts, settings).samples
    assert shares[0] and shares[1]  # both ranks sampled some of the first 6 rows
    keys = ("prompt", "completion", "prompt_index", "sample", "rewards")
    assert [[row[k] for k in keys] for row in logged[0]] == [[row[k] for k in keys] for row in one.samples]
    assert [(row["prompt_index"], row["sample"]) for row in one.samples] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                                              (1, 0), (1, 1)]  # fmt: skip


class _Train:
    def __init__(self):
        self.calls = []

    def __call__(self, state, micro_batches):
        self.calls.append((state.global_step, micro_batches))
        return {"loss": torch.tensor(0.0)}


def test_the_phase_generates_once_per_batch_and_a_checkpoint_inside_it_resumes_the_same_micro_batches():
    settings = _settings(num_iterations=2, beta=0.1)  # R = 2 steps per generation batch
    parts = rollout_parts(_policy(), reference=_logps)
    made = []

    def generate(state, prompts, index):
        made.append(index)
        return rollout(prompts, index, parts, settings, state)

    phase, train = rollout_phase(generate, settings), _Train()
    batch = [_prompts(1)]
    first = phase.step(TrainState(0, 0, 0), batch, train)
    assert "reward" in first and "time/train_s" in first and first["num_tokens"] > 0
    saved = json.loads(json.dumps(phase.state_hook.state_dict()))  # what a checkpoint writes: JSON
    second = phase.step(TrainState(0, 1, 1), batch, train)
    assert made == [0] and "reward" not in second and second["num_tokens"] == first["num_tokens"]
    assert phase.state_hook.state_dict()["generation"] is None  # at the batch's edge nothing is kept

    resumed, again = rollout_phase(generate, settings), _Train()
    resumed.state_hook.load_state_dict(saved)
    resumed.step(TrainState(0, 1, 1), batch, again)
    assert made == [0]  # restored, not generated again
    for expected, got in zip(train.calls[1][1], again.calls[0][1], strict=True):
        assert set(expected) == set(got) and all(torch.equal(expected[key], got[key]) for key in expected)
    assert phase.count_batch(None)[1] == 4 and phase.take_samples() and not phase.take_samples()


def test_a_batch_saved_on_other_ranks_is_refused_in_one_line():
    settings = _settings(num_iterations=2)
    phase = rollout_phase(lambda state, prompts, index: rollout(prompts, index, rollout_parts(_policy()), settings), settings)
    phase.step(TrainState(0, 0, 0), [_prompts(1)], _Train())
    saved = phase.state_hook.state_dict()
    saved["generation"]["dp_size"] = 2
    with pytest.raises(ValueError, match="saved inside generation batch 0 on 2 data-parallel ranks, whose rows are "
                                         "split by rank: resume it on 2 ranks"):  # fmt: skip
        rollout_phase(lambda *args: None, settings).state_hook.load_state_dict(saved)
