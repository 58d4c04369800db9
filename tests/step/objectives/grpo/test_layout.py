"""Which rows of a generation batch each rank trains on, and how rows become micro-batches
(fntrain.step.objectives.grpo.layout): the same optimizer steps on any world size."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives.grpo.layout import Row, micro_batch, plan_rows, shuffled_rows


def test_the_order_is_a_permutation_fixed_by_seed_and_generation():
    order = shuffled_rows(24, seed=7, generation=3)
    assert sorted(order) == list(range(24))
    assert order == shuffled_rows(24, seed=7, generation=3)
    assert order != shuffled_rows(24, seed=7, generation=4)
    assert order != shuffled_rows(24, seed=8, generation=3)


def test_one_process_cuts_each_step_block_into_its_micro_batches_in_order():
    order = list(range(12))
    plan = plan_rows(order, steps=2, micro_batches=3, micro_batch_size=2, dp_rank=0, dp_size=1)
    assert plan.steps == (((0, 1), (2, 3), (4, 5)), ((6, 7), (8, 9), (10, 11)))
    assert plan.rows == tuple(range(12))


@pytest.mark.parametrize(
    "dp_size, micro_batches, micro_batch_size", [(2, 2, 2), (4, 1, 2), (2, 1, 4), (8, 1, 1)]
)
def test_each_optimizer_step_trains_the_same_rows_on_any_world_size(dp_size, micro_batches, micro_batch_size):
    order = shuffled_rows(16, seed=1, generation=0)
    one = plan_rows(order, steps=2, micro_batches=8, micro_batch_size=1, dp_rank=0, dp_size=1)
    ranks = [plan_rows(order, steps=2, micro_batches=micro_batches, micro_batch_size=micro_batch_size,
                       dp_rank=rank, dp_size=dp_size) for rank in range(dp_size)]  # fmt: skip
    for step in range(2):
        alone = {row for micro in one.steps[step] for row in micro}
        spread = [row for plan in ranks for micro in plan.steps[step] for row in micro]
        assert sorted(spread) == sorted(alone) and len(spread) == len(set(spread))
    assert sorted(row for plan in ranks for row in plan.rows) == list(range(16))


def test_a_batch_that_does_not_fill_its_steps_is_refused():
    with pytest.raises(ValueError, match="12 rows does not fill 2 steps of 8"):
        plan_rows(list(range(12)), steps=2, micro_batches=2, micro_batch_size=2, dp_rank=0, dp_size=2)


def test_rows_are_right_padded_with_labels_on_the_trained_completion_only():
    rows = [Row((5, 6, 7), (8, 9)), Row((5,), (4,), trained=False), Row((1, 2), (3, 3, 3))]
    batch = micro_batch(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0], [1, 2, 3, 3, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    ignore = IGNORE_INDEX
    assert batch["labels"].tolist() == [
        [ignore, ignore, ignore, 8, 9], [ignore] * 5, [ignore, ignore, 3, 3, 3],
    ]  # fmt: skip
    assert all(tensor.dtype == torch.long for tensor in batch.values())
