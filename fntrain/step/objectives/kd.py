"""Knowledge distillation: a student trained on the labels and on a frozen teacher's distribution.

    forward = make_kd_forward(teacher)                   # KDOutput(student_logits, teacher_logits)
    loss_fn = make_kd_loss(config)                       # -> (loss, {"kd/ce": ..., "kd/kl": ...})

    loss = (1 − ratio) · CE(student, labels) + ratio · T² · FKL_T(teacher ‖ student)

FKL is torchtune's `ForwardKLLoss`: per target position −Σ_v p_teacher(v) log p_student(v) (the
teacher-weighted cross-entropy, which differs from KL(teacher ‖ student) by the teacher's entropy, a
constant for the student: the same gradient), positions where the student's logit is infinite
masked out, averaged over the valid (shifted) target positions, 0 when there are none. With a
temperature T both distributions are softmax(logits / T), and the term is scaled by T² (Hinton et
al. 2015): soft targets' gradients shrink as 1/T², and T² keeps the KL term's weight against the
cross-entropy independent of T. At T = 1 it is torchtune's number exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from fntrain.config import require_choice, require_float, require_str
from fntrain.data.tokens import IGNORE_INDEX, loss_targets
from fntrain.step.losses import causal_lm_loss, default_forward
from fntrain.step.objectives.logps import full_logits, output_logits

__all__ = ["KDConfig", "KDOutput", "forward_kl", "make_kd_forward", "make_kd_loss"]

_TEACHER_DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass(frozen=True)
class KDConfig:
    """Knowledge distillation from a frozen teacher with the student's vocabulary."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("teacher_path",)

    ratio: float = 0.5
    """Weight of the distillation term, in [0, 1]: loss = (1 - ratio) * cross-entropy + ratio * KL (0: plain fine-tuning, 1: distillation only)."""
    temperature: float = 1.0
    """Softmax temperature of both distributions in the KL term (> 0); the term is scaled by temperature**2 (Hinton)."""
    teacher_path: str = ""
    """The teacher's local model directory (config.json + safetensors), with the student's tokenizer. Required."""
    teacher_dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = None
    """Dtype of the teacher's loaded weights (auto: the checkpoint's; None: the same as --model.dtype)."""

    def validate(self, prefix: str = "kd") -> None:
        """Value rules naming `prefix.field` (e.g. `kd.ratio must be <= 1, got 1.5`); the teacher
        directory's contents are the recipe's to check (the models layer reads them)."""
        require_float(f"{prefix}.ratio", self.ratio, min=0, max=1)
        require_float(f"{prefix}.temperature", self.temperature, min=0, min_exclusive=True)
        require_str(f"{prefix}.teacher_path", self.teacher_path)
        if not self.teacher_path:
            raise ValueError(
                f"{prefix}.teacher_path is required: the teacher's local model directory (config.json + safetensors)"
            )
        if self.teacher_dtype is not None:
            require_choice(f"{prefix}.teacher_dtype", self.teacher_dtype, _TEACHER_DTYPES)


@dataclass(frozen=True)
class KDOutput:
    """What a KD forward returns: the student's logits (with gradient) and the teacher's (without)."""

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor


def _check_vocab(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            f"the teacher's vocabulary ({teacher_logits.shape[-1]} logits) differs from the student's "
            f"({student_logits.shape[-1]}): distillation needs a teacher with the student's tokenizer"
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"the teacher's logits {tuple(teacher_logits.shape)} and the student's "
            f"{tuple(student_logits.shape)} differ in shape"
        )


def _masked_forward_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor, temperature: float
) -> torch.Tensor:
    """T² · mean over the `valid` positions of −Σ_v softmax(t/T) log_softmax(s/T), float32; 0 when no
    position is valid (a clamped divisor, not a host-side check). Logits and `valid` share positions."""
    if temperature != 1.0:
        student_logits, teacher_logits = student_logits / temperature, teacher_logits / temperature
    teacher_probs = F.softmax(teacher_logits.detach(), dim=-1, dtype=torch.float32)
    student_logprobs = F.log_softmax(student_logits, dim=-1, dtype=torch.float32)
    # An infinite student logit (a masked vocabulary entry) gives 0 · −inf = NaN: torchtune masks it out.
    products = (teacher_probs * student_logprobs).masked_fill(torch.isinf(student_logits), 0.0)
    per_position = -products.sum(-1)
    valid = valid.to(per_position.dtype)
    return (temperature**2) * (per_position * valid).sum() / valid.sum().clamp(min=1)


def forward_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """torchtune's `ForwardKLLoss` over next-token positions (module docstring): logits (..., T, V)
    at every position, `labels` (..., T) unshifted, so logits[..., :-1] are scored where
    labels[..., 1:] != ignore_index. With a temperature both softmaxes are at T and the result is
    scaled by T². A ValueError when the teacher's vocabulary (last dim) differs from the student's.
    Vocabulary-parallel (DTensor) logits are gathered whole first (`full_logits`)."""
    student_logits, teacher_logits = full_logits(student_logits), full_logits(teacher_logits)
    _check_vocab(student_logits, teacher_logits)
    valid = labels[..., 1:] != ignore_index
    return _masked_forward_kl(student_logits[..., :-1, :], teacher_logits[..., :-1, :], valid, temperature)


def make_kd_forward(
    teacher: torch.nn.Module,
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] = default_forward,
) -> Callable[[torch.nn.Module, Mapping[str, Any]], KDOutput]:
    """`forward(model, micro_batch) -> KDOutput`: the teacher's logits under `torch.no_grad()` (the
    teacher is put in eval mode here), then the student's through `forward`."""
    teacher.eval()

    def kd_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> KDOutput:
        with torch.no_grad():
            teacher_logits = output_logits(forward(teacher, micro_batch))
        return KDOutput(output_logits(forward(model, micro_batch)), teacher_logits)

    return kd_forward


def make_kd_loss(
    config: KDConfig, ignore_index: int = IGNORE_INDEX
) -> Callable[[KDOutput, Mapping[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """`loss_fn(output, micro_batch) -> (loss, {"kd/ce", "kd/kl"})`: (1 − ratio)·CE + ratio·KL, both
    means over the same valid target tokens (`fntrain.data.tokens.loss_targets`: labels, loss_mask,
    shift_labels), so the step's token weighting applies as to plain fine-tuning; 0 when no token is
    valid. CE is `causal_lm_loss` (vocabulary-parallel logits stay split for it, under the step's
    loss_parallel()); KL is `forward_kl`'s term. Metrics are detached 0-d tensors; no host sync. Only
    ratio and temperature are checked here (the teacher is the recipe's)."""
    require_float("kd.ratio", config.ratio, min=0, max=1)
    require_float("kd.temperature", config.temperature, min=0, min_exclusive=True)
    ratio, temperature = config.ratio, config.temperature

    def kd_loss_fn(
        output: KDOutput, micro_batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        student, teacher = output.student_logits, output.teacher_logits
        _check_vocab(student, teacher)
        ce = causal_lm_loss(student, micro_batch, ignore_index)  # vocabulary-parallel under loss_parallel()
        student, teacher = full_logits(student), full_logits(teacher)
        _, valid = loss_targets(micro_batch, ignore_index)
        if "shift_labels" not in micro_batch:
            student, teacher = student[..., :-1, :], teacher[..., :-1, :]
        kl = _masked_forward_kl(student, teacher, valid, temperature)
        loss = (1 - ratio) * ce + ratio * kl
        return loss, {"kd/ce": ce.detach(), "kd/kl": kl.detach()}

    return kd_loss_fn
