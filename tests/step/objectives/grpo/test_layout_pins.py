"""Pins of fntrain/step/objectives/grpo/layout.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

from fntrain.step.objectives.grpo.layout import Row, micro_batch, shuffled_rows


def test_the_training_order_of_a_seed_and_generation_is_pinned():
    # A resumed run, another world size or a later fntrain version must train the rows in this order.
    assert shuffled_rows(8, 42, 0) == [5, 0, 7, 3, 6, 1, 4, 2]
    assert shuffled_rows(8, 42, 1) == [7, 3, 2, 5, 6, 1, 0, 4]


def test_a_micro_batch_is_made_on_the_device_asked_for():
    rows = [Row((1, 2), (3,)), Row((4,), (5, 6))]
    batch = micro_batch(rows, pad_id=0, device="meta")
    assert {name: tensor.device.type for name, tensor in batch.items()} == dict.fromkeys(batch, "meta")
