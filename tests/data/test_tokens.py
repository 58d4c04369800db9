"""Token and sample counting [S22] [S28]: pure functions over nested batches, no host sync."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.tokens import (
    IGNORE_INDEX,
    count_batch,
    count_loss_tokens,
    count_samples,
    count_tokens,
    loss_targets,
    micro_batches,
)


def labels_batch(rows: list[list[int]], **extra):
    return {"input_ids": torch.tensor(rows), "labels": torch.tensor(rows), **extra}


def test_targets_are_shifted_labels_and_ignore_index_is_invalid():
    mb = labels_batch([[5, 6, IGNORE_INDEX, 8], [1, 2, 3, 4]])
    targets, valid = loss_targets(mb)
    assert targets.tolist() == [[6, IGNORE_INDEX, 8], [2, 3, 4]]
    assert valid.tolist() == [[True, False, True], [True, True, True]]
    count = count_loss_tokens(mb)
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == 5


def test_shift_labels_are_used_as_given():
    mb = {"labels": torch.ones(1, 4, dtype=torch.long), "shift_labels": torch.tensor([[3, IGNORE_INDEX, 4]])}
    targets, valid = loss_targets(mb)
    assert targets.tolist() == [[3, IGNORE_INDEX, 4]] and int(count_loss_tokens(mb)) == 2
    assert int(count_loss_tokens({"shift_labels": torch.tensor([[0, 0]])}, ignore_index=0)) == 0


def test_loss_mask_is_shifted_with_the_labels_and_anded_with_ignore_index():
    mb = labels_batch([[1, 2, 3, IGNORE_INDEX]], loss_mask=torch.tensor([[1, 1, 0, 1]]))
    # targets [2, 3, -100]; mask[1:] = [1, 0, 1] -> only the first target is valid
    assert loss_targets(mb)[1].tolist() == [[True, False, False]]
    shifted = {"shift_labels": torch.tensor([[2, 3, 4]]), "loss_mask": torch.tensor([[True, False, True]])}
    assert int(count_loss_tokens(shifted)) == 2


def test_a_mask_whose_shape_differs_from_the_labels_is_an_error():
    with pytest.raises(ValueError, match=r"loss_mask shape \(1, 3\) differs from the labels shape \(1, 4\)"):
        count_loss_tokens(labels_batch([[1, 2, 3, 4]], loss_mask=torch.ones(1, 3)))
    with pytest.raises(ValueError, match=r"differs from the shift_labels shape \(2, 3\)"):
        count_loss_tokens({"shift_labels": torch.ones(2, 3, dtype=torch.long), "loss_mask": torch.ones(2, 4)})
    with pytest.raises(KeyError, match="needs `labels` or `shift_labels`"):
        loss_targets({"input_ids": torch.ones(1, 2)})


@pytest.mark.parametrize("flag", [True, torch.tensor(True), torch.tensor([True])])
def test_a_padding_micro_batch_counts_zero_tokens_and_samples(flag):
    real = labels_batch([[1, 2, 3], [4, 5, 6]])
    padding = labels_batch([[1, 2, 3], [4, 5, 6]], is_padding=flag)
    assert int(count_loss_tokens(padding)) == 0
    assert int(count_loss_tokens(labels_batch([[1, 2]], is_padding=torch.tensor(False)))) == 1
    tokens, samples = count_batch([real, padding])
    assert int(tokens) == 4 and samples == 2
    # Padding zeroes every counting path, not only labels.
    assert int(count_tokens({"input_ids": torch.ones(2, 5), "is_padding": flag})) == 0
    assert int(count_tokens({"token_count": 7, "is_padding": flag})) == 0


def test_token_precedence():
    ids = torch.ones(2, 4, dtype=torch.long)
    assert count_tokens({"input_ids": ids, "labels": ids, "token_count": 3}) == 3
    assert int(count_tokens({"input_ids": ids, "labels": ids.masked_fill(ids.bool(), IGNORE_INDEX)})) == 0
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    assert int(count_tokens({"input_ids": ids, "attention_mask": mask})) == 5
    assert (
        count_tokens({"input_ids": ids, "attention_mask": torch.ones(2, 1, 4, 4)}) == 8
    )  # 4-D mask: not a count
    assert count_tokens({"input_ids": ids}) == 8
    assert count_tokens({"pixels": torch.ones(3, 3)}) == 0


def test_nested_batches_are_flattened_in_order():
    a = labels_batch([[1, 2, 3]])
    b = labels_batch([[1, 2, 3], [4, 5, 6]])
    nested = [[a, b], ({"input_ids": torch.ones(3, 2)},)]
    assert micro_batches(nested) == [a, b, nested[1][0]]
    assert micro_batches(a) == [a]
    tokens, samples = count_batch(nested)
    assert int(tokens) == 2 + 4 + 6 and samples == 1 + 2 + 3
    assert count_batch([torch.ones(4, 3)]) == (12, 4)  # a bare tensor micro-batch
    assert count_samples([{"meta": {"pixels": torch.ones(5, 2)}}]) == 5


def test_counts_stay_on_the_batch_device_without_a_sync():
    # On the meta device any host read would fail, so this proves counting never leaves the device.
    mb = {
        "input_ids": torch.empty(2, 8, dtype=torch.long, device="meta"),
        "labels": torch.empty(2, 8, dtype=torch.long, device="meta"),
        "loss_mask": torch.empty(2, 8, dtype=torch.bool, device="meta"),
        "is_padding": torch.empty((), dtype=torch.bool, device="meta"),
    }
    tokens, samples = count_batch([mb, mb])
    assert tokens.device.type == "meta" and tokens.dim() == 0
    assert samples == 4  # a flag on a device is not read; shapes give the samples


def test_count_batch_is_cheap():
    import time

    batch = [labels_batch([[1] * 128] * 16) for _ in range(2)]
    count_batch(batch)
    start = time.perf_counter()
    for _ in range(200):
        count_batch(batch)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 1e-3  # a few tens of microseconds in practice; generous for a loaded CI machine
