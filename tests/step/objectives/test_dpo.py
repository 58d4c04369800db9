"""Preference tuning (`fntrain.step.objectives.dpo`): each loss type against TRL 1.16's formula by hand,
summed completion log-probs (and their gradient) against a naive computation, TRL's metric names and
values, no host reads, the step taking the pair, dropout off, the config's messages. The reference
sources: test_dpo_reference.py; TRL's own loss code on the same numbers (slow): test_dpo_trl_loss.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import (
    DPOConfig,
    PreferenceOutput,
    completion_logps,
    disable_dropout,
    dpo_loss,
    frozen_reference,
    make_dpo_forward,
    make_dpo_loss,
    precomputed_reference,
)
from fntrain.step.objectives import logps as logps_module
from tests.step.host_reads import no_host_reads
from tests.step.objectives.preference_helpers import (
    METRIC_NAMES,
    PAIRS,
    SEQ,
    VOCAB,
    ToyLM,
    close,
    logsigmoid,
    naive_sequence_logps,
    preference_batch,
    toy_model,
)

# ----------------------------------------------------------------------------- completion log-probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_completion_logps_sums_the_completion_tokens(dtype):
    batch = preference_batch()
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=torch.Generator().manual_seed(3)).to(dtype)
    sums, counts = completion_logps(logits, batch["labels"])
    expected, expected_counts = naive_sequence_logps(logits.float(), batch["labels"])
    assert sums.dtype == torch.float32 and sums.shape == (2 * PAIRS,)
    assert torch.allclose(sums, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == expected_counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [1 << 26, 2 * VOCAB])  # whole rows; two positions a chunk
def test_completion_logps_gradient_is_log_softmax_gather_gradient(dtype, chunk_elements, monkeypatch):
    monkeypatch.setattr(logps_module, "_CHUNK_ELEMENTS", chunk_elements)
    labels = preference_batch()["labels"]
    start = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights = torch.linspace(-1.0, 2.0, 2 * PAIRS)
    logits = start.clone().requires_grad_(True)
    sums, _ = completion_logps(logits, labels)
    (sums * weights).sum().backward()
    naive = start.clone().requires_grad_(True)
    targets, valid = labels[:, 1:], labels[:, 1:] != IGNORE_INDEX
    per_token = torch.log_softmax(naive[:, :-1].float(), -1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
    expected_sums = (per_token.squeeze(-1) * valid).sum(-1)
    (expected_sums * weights).sum().backward()
    assert close(sums, expected_sums.detach())
    assert logits.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(logits.grad.float(), naive.grad.float(), atol=tolerance, rtol=tolerance)


def test_completion_logps_of_a_row_without_completion_is_zero():
    labels = torch.full((2, SEQ), IGNORE_INDEX)
    labels[1, 3] = 4
    logits = torch.randn(2, SEQ, VOCAB)
    sums, counts = completion_logps(logits, labels)
    assert sums[0].item() == 0.0 and counts.tolist() == [0, 1]
    assert sums[1].item() == pytest.approx(torch.log_softmax(logits[1, 2], -1)[4].item(), abs=1e-6)


# ----------------------------------------------------------------------------- each loss against TRL's formula

CHOSEN, REJECTED = [-5.0, -7.0, -3.0], [-6.0, -4.0, -3.5]
REF_CHOSEN, REF_REJECTED = [-5.5, -6.0, -3.2], [-5.0, -5.0, -3.0]
LENGTHS = [3, 4, 2, 5, 1, 6]  # chosen rows' completion tokens, then the rejected rows'


def dpo_by_hand(loss_type: str, beta: float, smoothing: float = 0.0, gamma: float = 0.5) -> list[tuple]:
    """(loss, chosen reward, rejected reward) per pair, from TRL 1.16's formulas in plain floats."""
    rows = []
    for i in range(3):
        u_c, u_r = CHOSEN[i] - REF_CHOSEN[i], REJECTED[i] - REF_REJECTED[i]
        n_c, n_r = LENGTHS[i], LENGTHS[3 + i]
        delta = u_c - u_r
        if loss_type == "sigmoid":
            loss = -logsigmoid(beta * delta)
        elif loss_type == "hinge":
            loss = max(0.0, 1 - beta * delta)
        elif loss_type == "ipo":
            loss = (u_c / n_c - u_r / n_r - 1 / (2 * beta)) ** 2
        elif loss_type == "robust":
            loss = (-(1 - smoothing) * logsigmoid(beta * delta) + smoothing * logsigmoid(-beta * delta)) / (
                1 - 2 * smoothing
            )
        else:  # simpo
            m = CHOSEN[i] / n_c - REJECTED[i] / n_r - gamma / beta
            loss = -(1 - smoothing) * logsigmoid(beta * m) - smoothing * logsigmoid(-beta * m)
            rows.append((loss, beta * CHOSEN[i] / n_c, beta * REJECTED[i] / n_r))
            continue
        rows.append((loss, beta * u_c, beta * u_r))
    return rows


@pytest.mark.parametrize(
    "config",
    [
        DPOConfig(),
        DPOConfig(beta=0.3, loss_type="hinge"),
        DPOConfig(beta=0.2, loss_type="ipo"),
        DPOConfig(beta=0.1, loss_type="robust", label_smoothing=0.2),
        DPOConfig(beta=0.1, loss_type="robust"),
        DPOConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.7),
        DPOConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.5, label_smoothing=0.1),
    ],
    ids=lambda c: f"{c.loss_type}-beta{c.beta}-ls{c.label_smoothing}",
)
def test_each_loss_type_matches_trl_formula(config):
    t = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
    references = (t(REF_CHOSEN), t(REF_REJECTED)) if config.needs_reference else (None, None)
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        t(CHOSEN), t(REJECTED), *references, torch.tensor(LENGTHS), config
    )
    expected = dpo_by_hand(config.loss_type, config.beta, config.label_smoothing, config.simpo_gamma)
    assert close(losses, t([row[0] for row in expected]))
    assert close(chosen_rewards, t([row[1] for row in expected]))
    assert close(rejected_rewards, t([row[2] for row in expected]))


def test_a_loss_with_a_reference_refuses_none():
    with pytest.raises(ValueError, match="needs the reference log-probs"):
        dpo_loss(torch.zeros(2), torch.zeros(2), None, None, torch.ones(4), DPOConfig(loss_type="ipo"))


# ----------------------------------------------------------------------------- the loss function and its metrics


def test_loss_fn_returns_the_mean_and_trl_metrics():
    batch = preference_batch()
    logits = torch.randn(
        2 * PAIRS, SEQ, VOCAB, generator=torch.Generator().manual_seed(5), requires_grad=True
    )
    reference = torch.tensor([-9.0, -8.0, -12.0, -10.0, -7.5, -11.0])
    config = DPOConfig(beta=0.25)
    loss, metrics = make_dpo_loss(config)(PreferenceOutput(logits, reference), batch)

    sums, counts = naive_sequence_logps(logits.detach(), batch["labels"])
    rewards_c = [0.25 * (sums[i] - reference[i].item()) for i in range(PAIRS)]
    rewards_r = [0.25 * (sums[PAIRS + i] - reference[PAIRS + i].item()) for i in range(PAIRS)]
    expected_loss = sum(-logsigmoid(c - r) for c, r in zip(rewards_c, rewards_r, strict=True)) / PAIRS
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert set(metrics) == METRIC_NAMES
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert metrics["rewards/chosen"].item() == pytest.approx(mean(rewards_c), rel=1e-5)
    assert metrics["rewards/rejected"].item() == pytest.approx(mean(rewards_r), rel=1e-5)
    assert metrics["rewards/margins"].item() == pytest.approx(mean(rewards_c) - mean(rewards_r), rel=1e-5)
    assert metrics["rewards/accuracies"].item() == pytest.approx(
        mean([c > r for c, r in zip(rewards_c, rewards_r, strict=True)])
    )
    assert metrics["logps/chosen"].item() == pytest.approx(mean(sums[:PAIRS]), rel=1e-5)
    assert metrics["logps/rejected"].item() == pytest.approx(mean(sums[PAIRS:]), rel=1e-5)
    # logits/*: the vocabulary-mean logit over the completion positions (TRL 1.16's token-weighted mean).
    valid = batch["labels"][:, 1:] != IGNORE_INDEX
    per_position = logits.detach()[:, :-1].mean(-1)
    assert metrics["logits/chosen"].item() == pytest.approx(
        per_position[:PAIRS][valid[:PAIRS]].mean().item(), rel=1e-5
    )
    assert metrics["logits/rejected"].item() == pytest.approx(
        per_position[PAIRS:][valid[PAIRS:]].mean().item(), rel=1e-5
    )
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_simpo_logs_per_token_log_probs_and_needs_no_reference():
    batch = preference_batch()
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=torch.Generator().manual_seed(6))
    loss, metrics = make_dpo_loss(DPOConfig(beta=2.0, loss_type="simpo"))(
        PreferenceOutput(logits, None), batch
    )
    sums, counts = naive_sequence_logps(logits, batch["labels"])
    averages = [s / n for s, n in zip(sums, counts, strict=True)]
    assert metrics["logps/chosen"].item() == pytest.approx(sum(averages[:PAIRS]) / PAIRS, rel=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(2.0 * sum(averages[:PAIRS]) / PAIRS, rel=1e-5)
    assert torch.isfinite(loss)


def test_loss_fn_refuses_a_missing_reference_and_odd_rows():
    batch = preference_batch()
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB)
    with pytest.raises(ValueError, match="needs the reference log-probs of the 6 rows"):
        make_dpo_loss(DPOConfig())(PreferenceOutput(logits, None), batch)
    odd = {key: value[:5] for key, value in batch.items() if key != "index"}
    with pytest.raises(ValueError, match="in pairs, got 5 rows"):
        make_dpo_loss(DPOConfig())(PreferenceOutput(logits[:5], torch.zeros(5)), odd)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_forward_loss_and_backward_read_no_values_on_the_host(loss_type):
    """No .item()/float()/bool() or data-dependent shape (a host sync on an accelerator) in the
    reference, the forward, the loss, its metrics or its backward."""
    policy = toy_model()
    batch = preference_batch()
    references = [frozen_reference(copy.deepcopy(policy)), precomputed_reference(torch.randn(PAIRS, 2))]
    with no_host_reads():
        for reference in references:
            output = make_dpo_forward(reference)(policy, batch)
            loss, metrics = make_dpo_loss(DPOConfig(loss_type=loss_type))(output, batch)
            loss.backward()
    assert len(metrics) == 8


def test_the_host_read_guard_catches_a_read():
    with pytest.raises(AssertionError, match="reads device values on the host"), no_host_reads():
        float(torch.ones(2).sum())


def test_the_step_takes_the_dpo_forward_and_loss_and_reports_the_metrics():
    from fntrain.state import TrainState
    from fntrain.step import StepSettings, make_train_step

    policy = toy_model()
    reference_model = copy.deepcopy(policy)
    before = [p.detach().clone() for p in reference_model.parameters()]
    step = make_train_step(
        policy,
        make_dpo_loss(DPOConfig()),
        torch.optim.SGD(policy.parameters(), lr=0.1),
        settings=StepSettings(loss_weighting="mean"),
        forward=make_dpo_forward(frozen_reference(reference_model)),
    )
    first = step(TrainState(), [preference_batch(seed=1), preference_batch(seed=2)])
    assert first["loss"].item() == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference
    assert METRIC_NAMES <= set(first)
    second = step(TrainState(), [preference_batch(seed=1), preference_batch(seed=2)])
    assert second["loss"].item() < math.log(2) and second["rewards/margins"].item() > 0
    assert all(torch.equal(a, b) for a, b in zip(before, reference_model.parameters(), strict=True))


def test_disable_dropout_sets_every_dropout_to_zero():
    model = ToyLM()
    assert model.drop.p == 0.5
    assert disable_dropout(model) is model and model.drop.p == 0.0


# ----------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"beta": 0.0}, "dpo.beta must be > 0, got 0.0"),
        ({"beta": True}, "dpo.beta must be a number, got True"),
        ({"loss_type": "kto"}, "dpo.loss_type must be one of"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "dpo.label_smoothing must be < 0.5, got 0.5"),
        ({"loss_type": "robust", "label_smoothing": -0.1}, "dpo.label_smoothing must be >= 0, got -0.1"),
        (
            {"label_smoothing": 0.1},
            "dpo.label_smoothing is read by the robust and simpo losses only, got 0.1 "
            "with dpo.loss_type 'sigmoid'",
        ),
        ({"simpo_gamma": -1.0}, "dpo.simpo_gamma must be >= 0, got -1.0"),
        ({"reference": "copied"}, "dpo.reference must be one of"),
        ({"reference_path": ""}, "dpo.reference_path must not be empty"),
        (
            {"reference": "adapter-off", "reference_path": "/ref"},
            "dpo.reference_path is not read with dpo.reference 'adapter-off' (the reference is the policy's "
            "own base model), got '/ref'",
        ),
    ],
)
def test_config_messages_name_the_field_and_value(changes, message):
    with pytest.raises((ValueError, TypeError)) as error:
        DPOConfig(**changes).validate()
    assert message in str(error.value)


def test_config_defaults_validate():
    DPOConfig().validate()
    DPOConfig(loss_type="simpo", reference="adapter-off", reference_path="/x").validate()
