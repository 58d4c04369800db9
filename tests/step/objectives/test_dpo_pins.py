"""Pins of fntrain/step/objectives/dpo.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import DPOConfig, PreferenceOutput, dpo_loss, make_dpo_forward, make_dpo_loss
from tests.step.objectives.preference_helpers import PAIRS, SEQ, VOCAB, preference_batch, toy_model


def _logits(rows: int = 2 * PAIRS, seed: int = 5) -> torch.Tensor:
    return torch.randn(rows, SEQ, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_the_logged_mean_logits_of_bfloat16_logits_are_summed_in_float32():
    """logits/chosen and logits/rejected of bf16 logits are the float32 means of those same values (a bf16
    sum over the vocabulary would be off in the third digit)."""
    batch = preference_batch()
    logits = (_logits() * 40 + 300).to(torch.bfloat16)  # large logits: a bf16 sum rounds visibly
    _, metrics = make_dpo_loss(DPOConfig())(PreferenceOutput(logits, torch.zeros(2 * PAIRS)), batch)
    valid = batch["labels"][:, 1:] != IGNORE_INDEX
    per_position = logits[:, :-1].double().mean(-1)
    chosen = per_position[:PAIRS][valid[:PAIRS]].mean().item()
    rejected = per_position[PAIRS:][valid[PAIRS:]].mean().item()
    assert metrics["logits/chosen"].dtype == torch.float32
    assert metrics["logits/chosen"].item() == pytest.approx(chosen, rel=1e-6)
    assert metrics["logits/rejected"].item() == pytest.approx(rejected, rel=1e-6)


def test_the_mean_logits_of_a_single_completion_token_are_that_positions_mean():
    """A micro-batch whose chosen completions hold one token in all: logits/chosen is that position's
    vocabulary-mean logit (divided by one token, not more)."""
    logits = _logits(rows=2)
    labels = torch.full((2, SEQ), IGNORE_INDEX)
    labels[0, 3] = 4  # the chosen row: one completion token, predicted at position 2
    labels[1, 2:5] = 1  # the rejected row: three
    _, metrics = make_dpo_loss(DPOConfig())(PreferenceOutput(logits, torch.zeros(2)), {"labels": labels})
    assert metrics["logits/chosen"].item() == pytest.approx(logits[0, 2].mean().item(), rel=1e-6)
    assert metrics["logits/rejected"].item() == pytest.approx(logits[1, 1:4].mean().item(), rel=1e-6)


def test_a_micro_batch_of_one_or_two_pairs_is_accepted():
    """Any even number of rows is whole pairs: 2 and 4 rows train, 3 rows are refused."""
    for pairs in (1, 2):
        batch = preference_batch(pairs=pairs)
        loss, _ = make_dpo_loss(DPOConfig())(
            PreferenceOutput(_logits(2 * pairs), torch.zeros(2 * pairs)), batch
        )
        assert torch.isfinite(loss)
    three = {"labels": preference_batch(pairs=2)["labels"][:3]}
    with pytest.raises(ValueError, match="in pairs, got 3 rows"):
        make_dpo_loss(DPOConfig())(PreferenceOutput(_logits(3), torch.zeros(3)), three)


def test_a_reference_of_the_wrong_shape_is_refused_naming_its_shape():
    batch = preference_batch()
    with pytest.raises(ValueError, match=r"needs the reference log-probs of the 6 rows .*got \(4,\)"):
        make_dpo_loss(DPOConfig())(PreferenceOutput(_logits(), torch.zeros(4)), batch)


def test_another_ignore_index_masks_the_prompt_and_padding_as_the_default_does():
    """make_dpo_loss(config, ignore_index=-1) on labels masked with -1 gives the loss and metrics of the
    default -100 on the same labels."""
    batch = preference_batch()
    other = {**batch, "labels": batch["labels"].masked_fill(batch["labels"] == IGNORE_INDEX, -1)}
    output = PreferenceOutput(_logits(), torch.tensor([-9.0, -8.0, -12.0, -10.0, -7.5, -11.0]))
    loss, metrics = make_dpo_loss(DPOConfig(beta=0.25))(output, batch)
    other_loss, other_metrics = make_dpo_loss(DPOConfig(beta=0.25), ignore_index=-1)(output, other)
    assert other_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    for name, value in metrics.items():
        assert other_metrics[name].item() == pytest.approx(value.item(), rel=1e-6, abs=1e-7), name


def test_the_loss_refuses_one_missing_reference_half():
    """Reference log-probs for the chosen rows but not the rejected ones are refused in one line naming the
    loss type, not a TypeError from inside the arithmetic."""
    with pytest.raises(ValueError, match="dpo.loss_type 'sigmoid' needs the reference log-probs, got None"):
        dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), None, torch.ones(4), DPOConfig())
    with pytest.raises(ValueError, match="needs the reference log-probs, got None"):
        dpo_loss(torch.zeros(2), torch.zeros(2), None, torch.zeros(2), torch.ones(4), DPOConfig())


def test_an_unknown_loss_type_is_refused_naming_the_choices():
    """dpo_loss called with a config that was never validated names the loss types it knows."""
    with pytest.raises(ValueError) as error:
        dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(4),
                 DPOConfig(loss_type="kto"))  # fmt: skip
    assert str(error.value) == (
        "dpo.loss_type must be one of ['hinge', 'ipo', 'robust', 'sigmoid', 'simpo'], got 'kto'"
    )


def test_the_forward_without_a_reference_runs_the_policy_alone():
    """make_dpo_forward(None) (simpo) gives the policy's logits and no reference log-probs."""
    policy = toy_model()
    batch = preference_batch()
    output = make_dpo_forward(None)(policy, batch)
    assert output.reference_logps is None
    assert torch.equal(output.logits, policy(batch["input_ids"]))
