"""Knowledge distillation (`fntrain.step.objectives.kd`): torchtune's ForwardKLLoss by hand (masked
mean over the shifted targets, infinite student logits masked, 0 without targets), the temperature's
T² scaling, the mixed loss against a direct computation (ratio 0 = cross-entropy, ratio 1 = KL), a
teacher with another vocabulary refused, the teacher run without gradient, the config's messages."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step import causal_lm_loss
from fntrain.step.objectives import KDConfig, KDOutput, forward_kl, make_kd_forward, make_kd_loss
from tests.step.host_reads import no_host_reads
from tests.step.objectives.preference_helpers import close

VOCAB, WIDTH, SEQ, ROWS = 11, 8, 6, 3


class DistillLM(nn.Module):
    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def kd_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels = ids.clone()
    labels[:, :2] = IGNORE_INDEX  # a prompt
    labels[2, 4:] = IGNORE_INDEX  # padding
    return {"input_ids": ids, "labels": labels}


def logits_pair(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, SEQ, VOCAB, generator=generator), torch.randn(
        ROWS, SEQ, VOCAB, generator=generator
    )


def naive_fkl(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> float:
    """torchtune's ForwardKLLoss, position by position: −Σ_v p_t log p_s over the positions whose next
    label is valid (terms where the student's logit is infinite skipped), averaged; × T²."""
    total, count = 0.0, 0
    for row in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            if labels[row, t + 1] == IGNORE_INDEX:
                continue
            p_teacher = torch.softmax(teacher[row, t].double() / temperature, -1)
            log_p_student = torch.log_softmax(student[row, t].double() / temperature, -1)
            finite = torch.isfinite(student[row, t])
            total += -(p_teacher[finite] * log_p_student[finite]).sum().item()
            count += 1
    return temperature**2 * total / max(count, 1)


def test_forward_kl_at_temperature_one_is_torchtune_forward_kl():
    student, teacher = logits_pair()
    labels = kd_batch()["labels"]
    assert forward_kl(student, teacher, labels).item() == pytest.approx(
        naive_fkl(student, teacher, labels), rel=1e-5
    )


def test_forward_kl_with_a_temperature_softens_both_and_scales_by_its_square():
    student, teacher = logits_pair()
    labels = kd_batch()["labels"]
    value = forward_kl(student, teacher, labels, temperature=2.0)
    assert value.item() == pytest.approx(naive_fkl(student, teacher, labels, temperature=2.0), rel=1e-5)
    assert value.item() == pytest.approx(4 * forward_kl(student / 2, teacher / 2, labels).item(), rel=1e-5)


def test_forward_kl_masks_infinite_student_logits_and_is_zero_without_targets():
    student, teacher = logits_pair()
    student[:, :, 3] = float("-inf")  # a vocabulary entry the student may never emit
    labels = kd_batch()["labels"]
    value = forward_kl(student, teacher, labels)
    assert torch.isfinite(value)
    assert value.item() == pytest.approx(naive_fkl(student, teacher, labels), rel=1e-5)
    none = torch.full_like(labels, IGNORE_INDEX)
    assert forward_kl(student, teacher, none).item() == 0.0


def test_forward_kl_is_minimal_where_the_student_is_the_teacher():
    student, teacher = logits_pair()
    labels = kd_batch()["labels"]
    # −Σ p log q ≥ −Σ p log p (Gibbs): the teacher's entropy, reached at student = teacher.
    assert forward_kl(teacher, teacher, labels) < forward_kl(student, teacher, labels)


def test_mismatched_vocabularies_are_refused():
    student, _ = logits_pair()
    teacher = torch.randn(ROWS, SEQ, VOCAB + 1)
    with pytest.raises(
        ValueError, match=r"teacher's vocabulary \(12 logits\) differs from the student's \(11\)"
    ):
        forward_kl(student, teacher, kd_batch()["labels"])
    with pytest.raises(ValueError, match="teacher's vocabulary"):
        make_kd_loss(KDConfig(teacher_path="/t"))(KDOutput(student, teacher), kd_batch())


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kd_loss_mixes_cross_entropy_and_kl(ratio, temperature):
    student, teacher = logits_pair()
    micro_batch = kd_batch()
    config = KDConfig(ratio=ratio, temperature=temperature, teacher_path="/t")
    loss, metrics = make_kd_loss(config)(KDOutput(student, teacher), micro_batch)
    ce = causal_lm_loss(student, micro_batch)
    kl = naive_fkl(student, teacher, micro_batch["labels"], temperature)
    assert loss.item() == pytest.approx((1 - ratio) * ce.item() + ratio * kl, rel=1e-5)
    assert set(metrics) == {"kd/ce", "kd/kl"}
    assert metrics["kd/ce"].item() == pytest.approx(ce.item(), rel=1e-6)
    assert metrics["kd/kl"].item() == pytest.approx(kl, rel=1e-5)
    assert all(value.dim() == 0 and not value.requires_grad for value in metrics.values())
    if ratio == 0.0:
        assert loss.item() == ce.item()
    if ratio == 1.0:
        assert loss.item() == forward_kl(student, teacher, micro_batch["labels"], temperature).item()


def test_kd_loss_respects_the_loss_mask_like_cross_entropy():
    student, teacher = logits_pair()
    micro_batch = kd_batch()
    micro_batch["loss_mask"] = torch.ones_like(micro_batch["labels"])
    micro_batch["loss_mask"][0, 3:] = 0
    masked_labels = micro_batch["labels"].clone()
    masked_labels[0, 3:] = IGNORE_INDEX
    _, metrics = make_kd_loss(KDConfig(ratio=1.0, teacher_path="/t"))(KDOutput(student, teacher), micro_batch)
    assert metrics["kd/kl"].item() == pytest.approx(naive_fkl(student, teacher, masked_labels), rel=1e-5)


def test_kd_loss_is_zero_without_valid_tokens():
    student, teacher = logits_pair()
    micro_batch = {"input_ids": kd_batch()["input_ids"], "labels": torch.full((ROWS, SEQ), IGNORE_INDEX)}
    loss, _ = make_kd_loss(KDConfig(teacher_path="/t"))(KDOutput(student, teacher), micro_batch)
    assert loss.item() == 0.0


def test_kd_forward_loss_and_backward_read_no_values_on_the_host():
    """No .item()/float()/bool() or data-dependent shape (a host sync on an accelerator)."""
    torch.manual_seed(0)
    student, teacher = DistillLM(), DistillLM()
    micro_batch = kd_batch()
    with no_host_reads():
        output = make_kd_forward(teacher)(student, micro_batch)
        loss, metrics = make_kd_loss(KDConfig(temperature=2.0, teacher_path="/t"))(output, micro_batch)
        loss.backward()
    assert set(metrics) == {"kd/ce", "kd/kl"}


def test_kd_forward_runs_the_teacher_without_gradient():
    torch.manual_seed(0)
    student, teacher = DistillLM(), DistillLM()
    teacher.train()
    reference_teacher = copy.deepcopy(teacher)
    micro_batch = kd_batch()
    output = make_kd_forward(teacher)(student, micro_batch)
    assert not teacher.training and not output.teacher_logits.requires_grad
    assert close(output.teacher_logits, reference_teacher(micro_batch["input_ids"]))
    loss, _ = make_kd_loss(KDConfig(ratio=0.5, teacher_path="/t"))(output, micro_batch)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())


def test_the_step_takes_the_kd_forward_and_loss_and_reports_the_metrics():
    from fntrain.state import TrainState
    from fntrain.step import make_train_step

    torch.manual_seed(0)
    student, teacher = DistillLM(), DistillLM()
    before = [p.detach().clone() for p in teacher.parameters()]
    step = make_train_step(
        student,
        make_kd_loss(KDConfig(ratio=0.5, teacher_path="/t")),
        torch.optim.SGD(student.parameters(), lr=0.1),
        forward=make_kd_forward(teacher),
    )
    micro_batches = [kd_batch(seed=1), kd_batch(seed=2)]
    metrics = step(TrainState(), micro_batches)
    assert {"kd/ce", "kd/kl", "loss"} <= set(metrics)
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters(), strict=True))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"ratio": 1.5}, "kd.ratio must be <= 1, got 1.5"),
        ({"ratio": -0.1}, "kd.ratio must be >= 0, got -0.1"),
        ({"temperature": 0.0}, "kd.temperature must be > 0, got 0.0"),
        ({"teacher_path": ""}, "kd.teacher_path is required"),
        ({"teacher_dtype": "int8"}, "kd.teacher_dtype must be one of"),
    ],
)
def test_config_messages_name_the_field_and_value(changes, message):
    config = KDConfig(**{"teacher_path": "/teacher", **changes})
    with pytest.raises(ValueError, match=None) as error:
        config.validate()
    assert message in str(error.value)


def test_config_defaults_validate_with_a_teacher():
    KDConfig(teacher_path="/teacher").validate()
    KDConfig(teacher_path="/teacher", teacher_dtype="bfloat16").validate()
