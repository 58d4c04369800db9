"""Pins of fntrain/step/objectives/reference.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fntrain.step.losses import default_forward
from fntrain.step.objectives import adapter_off_reference, completion_logps, precompute_reference_logps
from tests.step.objectives.preference_helpers import close, preference_batch, toy_model
from tests.step.objectives.test_reference import AdapterModel

PAIRS = 5


def _pairs(indices: list[int] | None = None) -> list[dict]:
    """One-pair micro-batches; pair i carries dataset index `indices[i]` (default: its position)."""
    indices = indices or list(range(PAIRS))
    return [preference_batch(pairs=1, seed=10 + i, index=[index]) for i, index in enumerate(indices)]


def _collate(items: list[dict], with_index: bool = True) -> dict:
    """Chosen rows of every pair first, then the rejected rows, as the data side lays them out."""
    out = {
        key: torch.cat([item[key][:1] for item in items] + [item[key][1:] for item in items])
        for key in ("input_ids", "attention_mask", "labels")
    }
    if with_index:
        out["index"] = torch.cat([item["index"] for item in items])
    return out


def _by_hand(model: nn.Module, pair: dict) -> list[float]:
    logps, _ = completion_logps(model(pair["input_ids"]), pair["labels"])
    return logps.tolist()


def test_the_table_holds_each_pairs_chosen_and_rejected_log_probs_whatever_the_micro_batch_size():
    model = toy_model(seed=2)
    expected = torch.tensor([_by_hand(model, pair) for pair in _pairs()])
    for size in (1, 2, 5):
        table = precompute_reference_logps(model, _pairs(), _collate, micro_batch_size=size, device="cpu")
        assert close(table, expected), size


def test_each_pair_goes_through_the_reference_once():
    """Five pairs two at a time: three forwards of 4, 4 and 2 rows."""
    rows = []

    def counting_forward(model, micro_batch):
        rows.append(micro_batch["input_ids"].shape[0])
        return default_forward(model, micro_batch)

    precompute_reference_logps(toy_model(), _pairs(), _collate, 2, "cpu", forward=counting_forward)
    assert rows == [4, 4, 2]


def test_a_micro_batch_size_below_one_is_refused_naming_it():
    with pytest.raises(ValueError) as error:
        precompute_reference_logps(toy_model(), _pairs(), _collate, micro_batch_size=0, device="cpu")
    assert str(error.value) == "micro_batch_size must be >= 1, got 0"


def test_rows_go_to_their_dataset_index_or_without_one_to_their_position():
    """A collate's "index" places each pair's row (here the pairs carry the indices 4..0); a collate
    without one places them in dataset order."""
    model = toy_model(seed=2)
    reversed_pairs = _pairs([4, 3, 2, 1, 0])
    by_position = torch.tensor([_by_hand(model, pair) for pair in reversed_pairs])
    indexed = precompute_reference_logps(model, reversed_pairs, _collate, 2, "cpu")
    assert close(indexed, by_position.flip(0))
    positional = precompute_reference_logps(
        model, reversed_pairs, lambda items: _collate(items, with_index=False), 2, "cpu"
    )
    assert close(positional, by_position)


def test_the_table_is_made_on_the_device_asked_for_with_or_without_an_index():
    for with_index in (True, False):
        table = precompute_reference_logps(
            toy_model().to("meta"), _pairs(), lambda items, w=with_index: _collate(items, w), 2, "meta"
        )
        assert (table.device.type, table.dtype, tuple(table.shape)) == ("meta", torch.float32, (PAIRS, 2))


def test_a_collate_that_does_not_pair_its_rows_is_refused_in_one_line():
    def chosen_only(items):
        return {key: value[: len(items)] for key, value in _collate(items).items()}

    with pytest.raises(ValueError) as error:
        precompute_reference_logps(toy_model(), _pairs(), chosen_only, 2, "cpu")
    assert str(error.value) == (
        "collate made 2 rows of 2 pairs: a preference micro-batch holds each pair's chosen row (first half) "
        "and rejected row (second half)"
    )


def test_one_adapter_off_reference_serves_each_model_its_own_base():
    """The same reference function called with another policy (a rebuilt model) switches that policy's
    adapter off, not the first one's."""
    reference = adapter_off_reference()
    batch = preference_batch()
    for seed in (4, 5):
        base = toy_model(seed=seed)
        expected, _ = completion_logps(copy.deepcopy(base)(batch["input_ids"]), batch["labels"])
        assert close(reference(AdapterModel(base), batch), expected), seed


class TunerOnly(nn.Module):
    """peft's inner tuner (LoraModel): a `peft_config` but no `disable_adapter()`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = toy_model()
        self.peft_config = {"default": None}

    def forward(self, input_ids, **_):
        return self.model(input_ids)


def test_a_model_with_a_peft_config_but_no_adapter_switch_is_refused_naming_lora():
    with pytest.raises(
        ValueError, match="dpo.reference 'adapter-off' needs a LoRA model .* the policy is a TunerOnly"
    ):
        adapter_off_reference()(TunerOnly(), preference_batch())
