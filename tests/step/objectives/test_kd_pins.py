"""Pins of fntrain/step/objectives/kd.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import KDConfig, KDOutput, forward_kl, make_kd_loss
from tests.step.objectives.test_kd import ROWS, SEQ, VOCAB, kd_batch, logits_pair, naive_fkl


def test_a_teacher_of_another_length_is_refused_naming_both_shapes():
    student, teacher = logits_pair()
    with pytest.raises(ValueError) as error:
        forward_kl(student, teacher[:, :-1], kd_batch()["labels"])
    assert str(error.value) == (
        f"the teacher's logits ({ROWS}, {SEQ - 1}, {VOCAB}) and the student's ({ROWS}, {SEQ}, {VOCAB}) differ in shape"
    )


def test_bfloat16_logits_are_distilled_in_float32():
    """The KL term of bf16 logits is the float32 (here float64) number of those same bf16 values: both
    softmaxes are taken in float32, not in bf16 (off in the third digit)."""
    student, teacher = (logits * 4 for logits in logits_pair())
    student, teacher = student.to(torch.bfloat16), teacher.to(torch.bfloat16)
    labels = kd_batch()["labels"]
    value = forward_kl(student, teacher, labels)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(naive_fkl(student.float(), teacher.float(), labels), rel=2e-6)


def test_one_target_position_is_averaged_over_one():
    """With a single valid target the KL term is that position's teacher-weighted cross-entropy."""
    student, teacher = logits_pair()
    labels = torch.full((ROWS, SEQ), IGNORE_INDEX)
    labels[1, 3] = 2  # predicted at position 2 of row 1
    expected = -(torch.softmax(teacher[1, 2], -1) * torch.log_softmax(student[1, 2], -1)).sum().item()
    assert forward_kl(student, teacher, labels).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ratio": 1.5}, "kd.ratio must be <= 1, got 1.5"),
        ({"ratio": -0.1}, "kd.ratio must be >= 0, got -0.1"),
        ({"ratio": "half"}, "kd.ratio must be a number, got 'half'"),
        ({"temperature": 0.0}, "kd.temperature must be > 0, got 0.0"),
        ({"temperature": -1.0}, "kd.temperature must be > 0, got -1.0"),
        ({"temperature": "hot"}, "kd.temperature must be a number, got 'hot'"),
    ],
)
def test_the_loss_refuses_a_ratio_or_temperature_out_of_range_naming_the_flag(changes, message):
    """make_kd_loss checks ratio and temperature itself (a config that was never validated)."""
    with pytest.raises((ValueError, TypeError)) as error:
        make_kd_loss(KDConfig(teacher_path="", **changes))
    assert str(error.value) == message


def test_a_teacher_path_that_is_not_a_string_is_refused_naming_the_flag():
    with pytest.raises(TypeError, match="kd.teacher_path must be a str, got 3"):
        KDConfig(teacher_path=3).validate()


def test_another_ignore_index_masks_the_prompt_and_padding_as_the_default_does():
    """make_kd_loss(config, ignore_index=-1) on labels masked with -1 gives the loss and both parts of the
    default -100 on the same labels."""
    student, teacher = logits_pair()
    batch = kd_batch()
    other = {**batch, "labels": batch["labels"].masked_fill(batch["labels"] == IGNORE_INDEX, -1)}
    config = KDConfig(ratio=0.4, temperature=2.0, teacher_path="/t")
    loss, metrics = make_kd_loss(config)(KDOutput(student, teacher), batch)
    other_loss, other_metrics = make_kd_loss(config, ignore_index=-1)(KDOutput(student, teacher), other)
    assert other_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    for name in ("kd/ce", "kd/kl"):
        assert other_metrics[name].item() == pytest.approx(metrics[name].item(), rel=1e-6), name


def test_shifted_labels_give_the_loss_of_the_same_labels_unshifted():
    """A micro-batch with shift_labels (position t scored against shift_labels[t], as packed and
    context-parallel batches come) distils every position: the same loss as its unshifted labels."""
    student, teacher = logits_pair()
    batch = kd_batch()
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((ROWS, 1), IGNORE_INDEX)], dim=1)
    config = KDConfig(ratio=0.5, temperature=2.0, teacher_path="/t")
    loss, metrics = make_kd_loss(config)(KDOutput(student, teacher), batch)
    shifted_loss, shifted_metrics = make_kd_loss(config)(
        KDOutput(student, teacher), {"input_ids": batch["input_ids"], "shift_labels": shifted}
    )
    assert shifted_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    assert shifted_metrics["kd/kl"].item() == pytest.approx(metrics["kd/kl"].item(), rel=1e-6)
