"""Pins of fntrain/step/objectives/grpo/advantages.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import math

import pytest
import torch

from fntrain.step.objectives.grpo.advantages import group_advantages


def advantages(rewards, generations, scale="group", aggregation="sum_then_normalize", weights=None):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    functions = rewards.shape[1]
    weights = [1.0] * functions if weights is None else weights
    names = [f"f{index}" for index in range(functions)]
    return group_advantages(rewards, weights, generations, scale, aggregation, names)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_groups_of_one_completion_have_no_advantage_and_a_zero_std(aggregation):
    # The recipe asks for two generations or more; the function itself takes one (each row its own group).
    out = advantages([[1.0], [3.0]], 1, aggregation=aggregation)
    assert out.advantages.tolist() == [0.0, 0.0]
    if aggregation == "sum_then_normalize":
        assert out.metrics["frac_reward_zero_std"].item() == 1.0


def test_groups_of_two_are_scaled_by_their_own_std():
    out = advantages([[0.0], [1.0], [5.0], [5.0]], 2)
    spread = math.sqrt(0.5) + 1e-4
    assert out.advantages.tolist() == pytest.approx([-0.5 / spread, 0.5 / spread, 0.0, 0.0])
    assert out.metrics["frac_reward_zero_std"].item() == 0.5


def test_batch_scaling_of_one_or_two_rows():
    one = advantages([[2.0]], 1, scale="batch")
    assert one.advantages.tolist() == [0.0] and one.metrics["frac_reward_zero_std"].item() == 1.0
    two = advantages([[0.0], [1.0]], 1, scale="batch")  # each row its own group's mean; the batch's std
    assert two.advantages.tolist() == [0.0, 0.0] and two.metrics["frac_reward_zero_std"].item() == 0.0


def test_normalize_then_sum_centres_the_advantages_of_the_scored_rows():
    # A function that cannot score a row leaves the weighted sums off centre before the batch scaling.
    rewards = [[1.0, 0.0], [0.0, float("nan")], [1.0, 1.0], [1.0, 0.0]]
    out = advantages(rewards, 2, aggregation="normalize_then_sum", weights=[1.0, 2.0])
    assert out.advantages.mean().item() == pytest.approx(0.0, abs=1e-6)
    one = advantages([[4.0]], 1, aggregation="normalize_then_sum")
    assert one.advantages.tolist() == [0.0] and one.metrics["frac_reward_zero_std"].item() == 1.0


def test_normalize_then_sum_scales_each_group_by_its_own_std_before_the_batch():
    # Groups (0, 1) and (0, 3): each scaled by its own std first, so both come out about +-0.866 after the
    # batch scaling (scaled by one common number instead, the second group would be three times the first).
    out = advantages([[0.0], [1.0], [0.0], [3.0]], 2, aggregation="normalize_then_sum")
    assert out.advantages.tolist() == pytest.approx([-0.866, 0.866, -0.866, 0.866], abs=1e-3)
    one_group = advantages([[0.0], [1.0]], 2, aggregation="normalize_then_sum")
    assert one_group.advantages.tolist() == pytest.approx([-0.707, 0.707], abs=1e-3)


def test_advantages_are_float32_whatever_the_weights_dtype():
    rewards = torch.tensor([[0.0], [1.0]])
    out = group_advantages(rewards, torch.tensor([1.0], dtype=torch.float64), 2, "group", "sum_then_normalize", ["f"])
    assert out.advantages.dtype == torch.float32 and out.rewards.dtype == torch.float32


def test_bad_shapes_and_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"^grpo\.num_generations must be >= 1, got 0$"):
        advantages([[1.0], [2.0]], 0)
    with pytest.raises(ValueError, match=r"^rewards_per_func must be \(rows, functions\), got \(4,\)$"):
        group_advantages(torch.zeros(4), [1.0], 2, "group", "sum_then_normalize", ["f"])
    with pytest.raises(ValueError, match=r"^1 reward functions but 2 weights and 1 names \(one each\)$"):
        group_advantages(torch.zeros(4, 1), [1.0, 2.0], 2, "group", "sum_then_normalize", ["f"])
    with pytest.raises(ValueError, match=r"^grpo\.multi_objective_aggregation must be one of .*, got 'sum'$"):
        group_advantages(torch.zeros(4, 1), [1.0], 2, "group", "sum", ["f"])
