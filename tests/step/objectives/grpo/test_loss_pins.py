"""Pins for fntrain/step/objectives/grpo/loss.py (mutation testing, issue 49 item 4): the loss and the metrics
GRPO users train on and read, against TRL 1.16's `_compute_loss` definitions, where the module's tests left
a case open (a single token, exact clip bounds, zero advantages, right-padded rows, refusals' wording)."""

from __future__ import annotations

import math

import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives.grpo.loss import GRPOOutput, grpo_token_loss, make_grpo_forward, make_grpo_loss
from tests.step.objectives.grpo.test_loss import SEQ, VOCAB, grpo_config, labels_of, micro_batch, output_of


def exact_log(value: float) -> float:
    """A float32 log-ratio whose float32 exp is exactly `value` (so the ratio sits on a clip bound)."""
    x = torch.log(torch.tensor(value, dtype=torch.float32))
    for _ in range(64):
        got = torch.exp(x)
        if got.item() == torch.tensor(value, dtype=torch.float32).item():
            return x.item()
        x = torch.nextafter(x, torch.tensor(math.inf) if got < value else torch.tensor(-math.inf))
    raise AssertionError(f"no float32 x with exp(x) == {value}")


def one_token_metrics(log_ratio: float, advantage: float, **fields) -> dict[str, float]:
    """The clip metrics of one row with one trained token whose log importance ratio is `log_ratio`."""
    labels = labels_of([(1, 1)])
    logps, old = torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1)
    old[0, 0] = -log_ratio
    cfg = grpo_config(loss_type="bnpo", **fields)
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(
        output_of(logps), micro_batch(labels, [advantage], old_logps=old)
    )
    return {name: value.item() for name, value in metrics.items()}


@pytest.mark.parametrize("bound", ["low", "high"])
def test_a_ratio_exactly_on_a_clip_bound_is_not_counted_clipped(bound):
    """TRL counts a token low-clipped when r < 1 − ε (A < 0) and high-clipped when r > 1 + ε_high (A > 0): strict."""
    if bound == "low":
        metrics = one_token_metrics(exact_log(0.5), -1.0, epsilon=0.5, epsilon_high=1.0)
    else:
        metrics = one_token_metrics(exact_log(2.0), 1.0, epsilon=0.5, epsilon_high=1.0)
    assert (
        metrics["clip_ratio/low_mean"]
        == metrics["clip_ratio/high_mean"]
        == metrics["clip_ratio/region_mean"]
        == 0
    )


@pytest.mark.parametrize("log_ratio", [-2.0, 2.0])
def test_a_token_with_zero_advantage_is_never_counted_clipped(log_ratio):
    """A = 0: neither TRL's low (A < 0) nor its high (A > 0) clip region, however far the ratio is out."""
    metrics = one_token_metrics(log_ratio, 0.0)
    assert metrics["clip_ratio/region_mean"] == 0 and metrics["clip_ratio/high_max"] == 0


def test_the_clip_regions_follow_the_advantage_sign_not_its_size():
    """A small positive advantage (0.5) with a ratio below 1 − ε is not low-clipped; with one above
    1 + ε_high it is high-clipped; a small negative one (−0.5) below 1 − ε is low-clipped."""
    below, above = one_token_metrics(-1.0, 0.5), one_token_metrics(1.0, 0.5)
    assert below["clip_ratio/low_mean"] == 0 and below["clip_ratio/region_mean"] == 0
    assert above["clip_ratio/high_mean"] == 1 and above["clip_ratio/high_max"] == 1
    negative = one_token_metrics(-1.0, -0.5)
    assert negative["clip_ratio/low_mean"] == 1 and negative["clip_ratio/low_min"] == 1


def test_row_clip_extremes_of_right_padded_rows_are_their_tokens_fractions():
    """low_min is the smallest row's low-clipped fraction of its own tokens (positive here, not its
    negation), high_max the largest row's high-clipped fraction; padding (ratio 1 there) counts for nothing."""
    labels = labels_of([(1, 2), (1, 4)])  # row 0: 2 tokens then padding; row 1: 4 tokens
    logps, old = torch.zeros(2, SEQ - 1), torch.zeros(2, SEQ - 1)
    old[0, 0] = 1.0  # row 0 (A < 0): 1 of 2 tokens below 1 − ε
    old[1, :3] = 1.0  # row 1 (A < 0): 3 of 4
    cfg = grpo_config(loss_type="bnpo")
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(
        output_of(logps), micro_batch(labels, [-1.0, -1.0], old_logps=old)
    )
    assert metrics["clip_ratio/low_min"].item() == pytest.approx(0.5)
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(4 / 6)
    old[:, :] = -old  # now ratios above 1 + ε_high, with A > 0
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(
        output_of(logps), micro_batch(labels, [1.0, 1.0], old_logps=old)
    )
    assert metrics["clip_ratio/high_max"].item() == pytest.approx(0.75)


def test_sequence_level_clip_fractions_count_rows_not_tokens():
    """At sequence level each row is one ratio: one clipped row of three tokens is a clipped fraction of 1."""
    labels = labels_of([(1, 3)])
    logps, old = torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1)
    old[0, :3] = -1.0  # ratio e > 1 + ε_high, A > 0
    cfg = grpo_config(loss_type="bnpo", importance_sampling_level="sequence")
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(
        output_of(logps), micro_batch(labels, [1.0], old_logps=old)
    )
    assert metrics["clip_ratio/high_mean"].item() == 1 and metrics["clip_ratio/region_mean"].item() == 1


def test_a_single_token_metric_is_that_token_value():
    """The token means over one trained token are the token's own entropy and KL, not half of them."""
    labels = labels_of([(1, 1)])
    logps, ref, entropy = torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1)
    ref[0, 0], entropy[0, 0] = -0.5, 1.25
    cfg = grpo_config(loss_type="bnpo", beta=0.1, use_bias_correction_kl=False)
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(
        GRPOOutput(logps, entropy), micro_batch(labels, [1.0], ref_logps=ref)
    )
    assert metrics["entropy"].item() == pytest.approx(1.25)
    assert metrics["kl"].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_a_one_token_row_at_sequence_level_takes_that_token_ratio():
    """GSPO's ratio is exp of the mean log-ratio over the row's tokens: over one token, that token's."""
    labels = labels_of([(1, 1)])
    logps, old = torch.zeros(1, SEQ - 1), torch.zeros(1, SEQ - 1)
    old[0, 0] = -0.1
    objective = grpo_token_loss(logps, old, None, torch.tensor([1.0]), labels[:, 1:] != IGNORE_INDEX,
                                grpo_config(importance_sampling_level="sequence"))  # fmt: skip
    assert objective.ratio.item() == pytest.approx(math.exp(0.1))


def test_dapo_over_a_generation_batch_of_one_token_divides_by_one():
    """dapo: Σ m ℓ · dp · S / N, with N = 1 as it is (TRL clamps N at 1, not above)."""
    labels = labels_of([(1, 1)])
    loss_fn = make_grpo_loss(grpo_config(loss_type="dapo"), micro_batches=1, steps_per_generation=1)
    loss, _ = loss_fn(output_of(torch.zeros(1, SEQ - 1)), micro_batch(labels, [2.0], generation_tokens=1.0))
    assert loss.item() == pytest.approx(-2.0)


def test_a_rank_with_no_rows_leaves_the_clip_extremes_to_the_others():
    """A micro-batch of no rows has no extremes (NaN in one process) and, reduced with a rank that has
    rows, the other rank's low_min and high_max stand."""
    cfg = grpo_config(loss_type="bnpo")
    empty = micro_batch(torch.full((0, SEQ), IGNORE_INDEX), [])
    output = output_of(torch.zeros(0, SEQ - 1))
    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1)(output, empty)
    assert math.isnan(metrics["clip_ratio/low_min"].item()) and math.isnan(
        metrics["clip_ratio/high_max"].item()
    )
    other = torch.tensor([-0.25, 0.5])  # the other rank's (−low_min, high_max)

    def reduce(tensor, op):
        return torch.maximum(tensor, other) if op == "max" else tensor

    _, metrics = make_grpo_loss(cfg, micro_batches=1, steps_per_generation=1, all_reduce=reduce)(
        output, empty
    )
    assert metrics["clip_ratio/low_min"].item() == 0.25 and metrics["clip_ratio/high_max"].item() == 0.5


def test_the_forward_scores_with_the_given_model_ignore_index_and_temperature():
    """The custom forward gets the model and the micro-batch; labels equal to the given ignore_index are
    not scored; the entropy is that of softmax(logits / temperature)."""
    labels = labels_of([(1, 3)]).masked_fill(labels_of([(1, 3)]) == IGNORE_INDEX, -1)
    logits = torch.randn(1, SEQ, VOCAB, generator=torch.Generator().manual_seed(3))
    model, batch = object(), {"labels": labels}
    seen = []

    def forward(m, b):
        seen.append((m, b))
        return logits

    output = make_grpo_forward(0.5, forward=forward, ignore_index=-1)(model, batch)
    assert seen[0][0] is model and seen[0][1] is batch
    valid = labels[:, 1:] != -1
    scaled = torch.log_softmax(logits[:, :-1] / 0.5, -1)
    expected_logps = scaled.gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    expected_entropy = -(scaled.exp() * scaled).sum(-1) * valid
    assert torch.allclose(output.logps, expected_logps, atol=1e-6)
    assert torch.allclose(output.entropy, expected_entropy, atol=1e-5)


@pytest.mark.parametrize("name", ["micro_batches", "steps_per_generation", "dp_size"])
def test_a_count_below_one_is_refused_naming_it(name):
    counts = {"micro_batches": 1, "steps_per_generation": 1, "dp_size": 1, name: 0}
    with pytest.raises(ValueError, match=rf"^{name} must be >= 1, got 0$"):
        make_grpo_loss(grpo_config(), **counts)


def test_dapo_without_generation_tokens_is_refused_in_these_words():
    with pytest.raises(
        ValueError, match=r"^grpo\.loss_type 'dapo' needs the micro-batch's 'generation_tokens', got none$"
    ):
        make_grpo_loss(grpo_config(loss_type="dapo"), micro_batches=1, steps_per_generation=1)(
            output_of(torch.zeros(1, SEQ - 1)), micro_batch(labels_of([(1, 2)]), [1.0])
        )
