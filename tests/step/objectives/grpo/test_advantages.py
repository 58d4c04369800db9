"""GRPO's group advantages and reward metrics (fntrain.step.objectives.grpo.advantages), hand-computed;
TRL's own numbers on recorded scores are in test_trl_parity.py."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from fntrain.step.objectives.grpo.advantages import group_advantages, nanstd
from tests.step.host_reads import no_host_reads

NAN = float("nan")


def advantages_of(scores: list[list[float]], weights=(1.0,), group: int = 4, scale: str = "group",
                  aggregation: str = "sum_then_normalize", names=("r",)):  # fmt: skip
    with no_host_reads():
        return group_advantages(torch.tensor(scores), weights, group, scale, aggregation, list(names))


def scaled(values: list[float], std: float) -> list[float]:
    mean = statistics.fmean(values)
    return [(v - mean) / (std + 1e-4) for v in values]


def test_group_scaling_divides_by_the_group_std_with_bessel_correction():
    first, second = [1.0, 0.0, 1.0, 1.0], [0.2, 0.4, 0.9, 0.5]
    result = advantages_of([[v] for v in first + second])
    expected = scaled(first, statistics.stdev(first)) + scaled(second, statistics.stdev(second))
    assert result.advantages.tolist() == pytest.approx(expected, rel=1e-5)
    assert result.rewards.tolist() == pytest.approx(first + second)


def test_batch_scaling_divides_by_the_whole_batch_std_and_none_does_not_divide():
    first, second = [1.0, 0.0, 1.0, 1.0], [0.2, 0.4, 0.9, 0.5]
    std = statistics.stdev(first + second)
    batch = advantages_of([[v] for v in first + second], scale="batch")
    means = [statistics.fmean(first)] * 4 + [statistics.fmean(second)] * 4
    expected = [(v - m) / (std + 1e-4) for v, m in zip(first + second, means, strict=True)]
    assert batch.advantages.tolist() == pytest.approx(expected, rel=1e-5)
    none = advantages_of([[v] for v in first + second], scale="none")
    assert none.advantages.tolist() == pytest.approx(
        [v - m for v, m in zip(first + second, means, strict=True)]
    )


def test_a_group_of_equal_rewards_has_zero_advantages_and_counts_as_zero_std():
    result = advantages_of([[1.0]] * 4 + [[0.0], [1.0], [0.0], [1.0]])
    assert result.advantages[:4].eq(0).all() and result.advantages[4:].ne(0).all()
    assert result.metrics["frac_reward_zero_std"].item() == 0.5


def test_weights_sum_the_functions_skipping_unscored_ones():
    scores = [[1.0, 0.5], [0.0, NAN], [1.0, 1.0], [NAN, 0.0]]
    result = advantages_of(scores, weights=(1.0, 2.0), names=("a", "b"))
    rewards = [2.0, 0.0, 3.0, 0.0]  # NaN terms skipped
    assert result.rewards.tolist() == pytest.approx(rewards)
    assert result.advantages.tolist() == pytest.approx(scaled(rewards, statistics.stdev(rewards)), rel=1e-5)


def test_an_unscorable_row_has_nan_reward_zero_advantage_and_is_left_out_of_the_group():
    scores = [[1.0], [NAN], [0.0], [0.5]]
    result = advantages_of(scores)
    scored = [1.0, 0.0, 0.5]
    expected = scaled(scored, statistics.stdev(scored))
    assert result.advantages.tolist() == pytest.approx([expected[0], 0.0, expected[1], expected[2]], rel=1e-5)
    assert math.isnan(result.rewards[1].item())
    assert result.metrics["reward"].item() == pytest.approx(statistics.fmean(scored))


def test_a_group_with_one_scored_row_has_zero_advantages():
    """One value has no standard deviation (NaN): every advantage of the group is 0, as TRL's."""
    result = advantages_of([[2.0], [NAN], [NAN], [NAN], [1.0], [0.0], [1.0], [0.0]])
    assert result.advantages[:4].eq(0).all() and result.advantages[4:].ne(0).all()
    assert result.metrics["frac_reward_zero_std"].item() == 0.0  # NaN std is not zero std


def test_normalize_then_sum_scales_each_function_in_its_group_then_the_sum_over_the_batch():
    accuracy, style = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [0.1, 0.3, 0.2, 0.6, 0.5, 0.5, 0.9, 0.1]
    result = advantages_of([list(pair) for pair in zip(accuracy, style, strict=True)], weights=(1.0, 0.5),
                           aggregation="normalize_then_sum", names=("a", "s"))  # fmt: skip

    def in_groups(values: list[float]) -> list[float]:
        return [
            v
            for start in (0, 4)
            for v in scaled(values[start : start + 4], statistics.stdev(values[start : start + 4]))
        ]

    summed = [a + 0.5 * s for a, s in zip(in_groups(accuracy), in_groups(style), strict=True)]
    assert result.advantages.tolist() == pytest.approx(scaled(summed, statistics.stdev(summed)), rel=1e-4)
    # the logged reward is the plain weighted sum whatever the aggregation
    assert result.rewards.tolist() == pytest.approx(
        [a + 0.5 * s for a, s in zip(accuracy, style, strict=True)]
    )


def test_reward_metrics_per_function_leave_unscored_rows_out():
    scores = [[1.0, NAN], [0.0, 0.5], [1.0, 0.25], [0.5, NAN]]
    result = advantages_of(scores, weights=(1.0, 1.0), names=("accuracy", "format"))
    metrics = {name: value.item() for name, value in result.metrics.items()}
    assert metrics["rewards/accuracy/mean"] == pytest.approx(0.625)
    assert metrics["rewards/accuracy/std"] == pytest.approx(statistics.stdev([1.0, 0.0, 1.0, 0.5]))
    assert metrics["rewards/format/mean"] == pytest.approx(0.375)
    assert metrics["rewards/format/std"] == pytest.approx(statistics.stdev([0.5, 0.25]))
    rewards = [1.0, 0.5, 1.25, 0.5]
    assert metrics["reward"] == pytest.approx(statistics.fmean(rewards))
    assert metrics["reward_std"] == pytest.approx(statistics.stdev(rewards))
    assert set(metrics) == {"reward", "reward_std", "frac_reward_zero_std", "rewards/accuracy/mean",
                            "rewards/accuracy/std", "rewards/format/mean", "rewards/format/std"}  # fmt: skip


def test_nanstd_is_bessel_corrected_and_nan_below_two_values():
    assert nanstd(torch.tensor([1.0, NAN, 3.0])).item() == pytest.approx(math.sqrt(2.0))
    assert math.isnan(nanstd(torch.tensor([1.0, NAN])).item())
    rows = nanstd(torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, 4.0]]), dim=1)
    assert rows.tolist() == pytest.approx([1.0, 0.0])


def test_shapes_that_disagree_are_named():
    with pytest.raises(ValueError, match="5 rewarded rows are not whole groups of grpo.num_generations 2"):
        advantages_of([[1.0]] * 5, group=2)
    with pytest.raises(ValueError, match="2 reward functions but 1 weights and 1 names"):
        advantages_of([[1.0, 0.0]] * 2, group=2)
    with pytest.raises(ValueError, match="grpo.scale_rewards must be one of"):
        advantages_of([[1.0]] * 2, group=2, scale="rows")
