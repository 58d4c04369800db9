"""Pins of fntrain/data/preference_collate.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.preference_collate import make_preference_collate
from fntrain.data.tokens import IGNORE_INDEX

EXAMPLES = [
    {"index": 7, "chosen_input_ids": [5, 6, 7], "chosen_labels": [IGNORE_INDEX, 6, 7],
     "rejected_input_ids": [5, 8], "rejected_labels": [IGNORE_INDEX, 8]},
    {"index": 2, "chosen_input_ids": [9, 4], "chosen_labels": [IGNORE_INDEX, 4],
     "rejected_input_ids": [9, 3, 3], "rejected_labels": [IGNORE_INDEX, 3, 3]},
]  # fmt: skip


def test_by_default_a_batch_is_padded_to_its_longest_sequence_exactly():
    """Three tokens at most: three columns (pad_multiple 1, as TRL), pad id 0 allowed."""
    batch = make_preference_collate(0)(EXAMPLES)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 4, 0], [5, 8, 0], [9, 3, 3]]
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, 6, 7], [IGNORE_INDEX, 4, IGNORE_INDEX], [IGNORE_INDEX, 8, IGNORE_INDEX], [IGNORE_INDEX, 3, 3],
    ]  # fmt: skip
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    assert batch["index"].tolist() == [7, 2]


def test_every_field_is_a_long_tensor():
    """The model's embedding and the loss's gather take long ids; the mask is 1/0 longs, not floats."""
    batch = make_preference_collate(0, pad_multiple=4)(EXAMPLES)
    assert {name: tensor.dtype for name, tensor in batch.items()} == dict.fromkeys(batch, torch.long)


@pytest.mark.parametrize(
    "pad_id, pad_multiple, message",
    [
        (-1, 1, "pad_id must be >= 0, got -1"),
        (None, 1, "pad_id must be an int, got None"),
        (0, 0, "pad_multiple must be >= 1, got 0"),
        (0, 2.0, "pad_multiple must be an int, got 2.0"),
    ],
)
def test_a_bad_pad_id_or_multiple_is_refused_naming_it(pad_id, pad_multiple, message):
    with pytest.raises((ValueError, TypeError)) as error:
        make_preference_collate(pad_id, pad_multiple=pad_multiple)
    assert str(error.value) == message


def test_an_empty_batch_is_refused_in_one_line():
    with pytest.raises(ValueError) as error:
        make_preference_collate(0)([])
    assert str(error.value) == "the preference collate needs at least one example"
