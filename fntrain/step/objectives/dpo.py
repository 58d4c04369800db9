"""Preference tuning: DPO and its variants as a step's `forward` and `loss_fn`, numbers as TRL 1.16's.

    reference = frozen_reference(reference_model)        # or adapter_off_reference(), precomputed_reference(table)
    forward = make_dpo_forward(reference)                # None for simpo: no reference at all
    loss_fn = make_dpo_loss(config)                      # -> (loss, {"rewards/chosen": ..., ...})

A preference micro-batch holds 2B rows: rows 0..B-1 the chosen completions, rows B..2B-1 the rejected
ones of the same prompts, "labels" unshifted with the prompt and padding masked, "index" the B pairs'
dataset indices. With the policy's summed completion log-probs π_c, π_r, the reference's ρ_c, ρ_r,
the log-ratios u_c = π_c − ρ_c, u_r = π_r − ρ_r, Δ = u_c − u_r, β = config.beta, per pair:

    sigmoid   −log σ(βΔ)                                          (DPO; label smoothing not used, as TRL 1.16)
    robust    (−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)        (ε = label_smoothing, in [0, 0.5))
    hinge     max(0, 1 − βΔ)                                      (SLiC)
    ipo       (u_c/n_c − u_r/n_r − 1/(2β))²                       (n: completion tokens, as TRL 1.16)
    simpo     −(1−ε) log σ(βm) − ε log σ(−βm),  m = π_c/n_c − π_r/n_r − γ/β   (no reference)

DPO's rewards are β·u_c and β·u_r (token sums); SimPO's β·π_c/n_c and β·π_r/n_r. TRL 1.16's
DPOTrainer has no SimPO: its SimPO is `trl.experimental.cpo`'s CPOTrainer with loss_type "simpo" and
cpo_alpha 0 (no NLL term), whose numbers simpo matches, log-probs averaged over the completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from fntrain.config import require_choice, require_float, require_str
from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.losses import default_forward
from fntrain.step.objectives.logps import completion_logps, full_logits, output_logits
from fntrain.step.objectives.reference import Reference

__all__ = [
    "LOSS_TYPES", "REFERENCES", "DPOConfig", "PreferenceOutput", "dpo_loss", "make_dpo_forward", "make_dpo_loss",
    "disable_dropout",
]  # fmt: skip (the reference functions: fntrain.step.objectives.reference; all of them: the package)

LOSS_TYPES = ("sigmoid", "robust", "ipo", "hinge", "simpo")
REFERENCES = ("copy", "adapter-off", "precomputed")
_SMOOTHED = ("robust", "simpo")  # the loss types whose formula reads label_smoothing (TRL 1.16)


@dataclass(frozen=True)
class DPOConfig:
    """Preference tuning (DPO and variants), numbers as TRL 1.16's."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("reference_path",)

    beta: float = 0.1
    """How far the policy may move from the reference (the temperature of the implicit reward); IPO's τ; SimPO's reward scale. > 0."""
    loss_type: Literal["sigmoid", "robust", "ipo", "hinge", "simpo"] = "sigmoid"
    """sigmoid: DPO; robust: DPO robust to label noise (label_smoothing); ipo: IPO, length-normalised; hinge: SLiC; simpo: SimPO, reference-free and length-normalised (simpo_gamma)."""
    label_smoothing: float = 0.0
    """Assumed fraction of flipped preference labels, in [0, 0.5): read by robust and simpo only (TRL 1.16's sigmoid ignores it), so another loss type refuses a non-zero value."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ (simpo only; TRL's default 0.5), >= 0."""
    reference: Literal["copy", "adapter-off", "precomputed"] = "copy"
    """The reference model. copy: a frozen copy of the starting model, run every step; adapter-off: the policy with its LoRA adapter switched off (needs --lora.rank > 0; no second copy); precomputed: log-probs computed once before training with a frozen copy, which is then freed. simpo uses no reference: ignored."""
    reference_path: str | None = None
    """The reference model's local directory for copy and precomputed (None: the policy's own --model.path); adapter-off refuses one. simpo: ignored."""

    def validate(self, prefix: str = "dpo") -> None:
        """Value rules naming `prefix.field` (e.g. `dpo.beta must be > 0, got 0.0`)."""
        require_float(f"{prefix}.beta", self.beta, min=0, min_exclusive=True)
        require_choice(f"{prefix}.loss_type", self.loss_type, LOSS_TYPES)
        smoothing = require_float(f"{prefix}.label_smoothing", self.label_smoothing, min=0)
        if smoothing >= 0.5:
            raise ValueError(f"{prefix}.label_smoothing must be < 0.5, got {self.label_smoothing}")
        if smoothing > 0 and self.loss_type not in _SMOOTHED:
            raise ValueError(
                f"{prefix}.label_smoothing is read by the robust and simpo losses only, got "
                f"{self.label_smoothing} with {prefix}.loss_type {self.loss_type!r}"
            )
        require_float(f"{prefix}.simpo_gamma", self.simpo_gamma, min=0)
        require_choice(f"{prefix}.reference", self.reference, REFERENCES)
        require_str(f"{prefix}.reference_path", self.reference_path, optional=True, non_empty=True)
        if self.reference_path is not None and self.reference == "adapter-off" and self.needs_reference:
            raise ValueError(
                f"{prefix}.reference_path is not read with {prefix}.reference 'adapter-off' (the reference is "
                f"the policy's own base model), got {self.reference_path!r}"
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads reference log-probs (every loss type but simpo)."""
        return self.loss_type != "simpo"


@dataclass(frozen=True)
class PreferenceOutput:
    """What a DPO forward returns: the policy's logits (2B, T, V) and the reference's summed completion
    log-probs (2B,) float32, None when the loss needs no reference (simpo)."""

    logits: torch.Tensor
    reference_logps: torch.Tensor | None


def _smoothed_sigmoid(scaled: torch.Tensor, smoothing: float) -> torch.Tensor:
    """−(1−ε) log σ(x) − ε log σ(−x): the conservative (label-smoothed) sigmoid loss of CPO/SimPO."""
    return -F.logsigmoid(scaled) * (1 - smoothing) - F.logsigmoid(-scaled) * smoothing


def _simpo_loss(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, lengths: torch.Tensor, config: DPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO as TRL's CPOTrainer (loss_type "simpo", cpo_alpha 0) computes it, from summed log-probs."""
    chosen_avg, rejected_avg = _length_normalised(chosen_logps, rejected_logps, lengths)
    margin = chosen_avg - rejected_avg - config.simpo_gamma / config.beta
    losses = _smoothed_sigmoid(config.beta * margin, config.label_smoothing)
    return losses, config.beta * chosen_avg.detach(), config.beta * rejected_avg.detach()


def _length_normalised(
    chosen: torch.Tensor, rejected: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token averages of summed values over the completions' token counts (a count of 0 reads as 1,
    as TRL's IPO clamps it: an empty completion averages to 0, never NaN)."""
    chosen_lengths, rejected_lengths = lengths.clamp(min=1).to(chosen.dtype).chunk(2)
    return chosen / chosen_lengths, rejected / rejected_lengths


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    lengths: torch.Tensor,
    config: DPOConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(losses, chosen_rewards, rejected_rewards)`, each (B,), for `config.loss_type` as TRL 1.16
    computes them (formulas in the module docstring). Log-probs (B,) are summed over the completions;
    `lengths` (2B,) are their token counts, chosen then rejected (read by ipo and simpo). The
    reference log-probs may be None for simpo only. Rewards are detached."""
    if config.loss_type == "simpo":
        return _simpo_loss(chosen_logps, rejected_logps, lengths, config)
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"dpo.loss_type {config.loss_type!r} needs the reference log-probs, got None")
    beta = config.beta
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if config.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif config.loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif config.loss_type == "ipo":
        chosen_avg, rejected_avg = _length_normalised(chosen_logratios, rejected_logratios, lengths)
        losses = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
    elif config.loss_type == "robust":
        smoothing = config.label_smoothing
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * smoothing)
    else:
        raise ValueError(f"dpo.loss_type must be one of {sorted(LOSS_TYPES)}, got {config.loss_type!r}")
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def make_dpo_forward(
    reference: Reference | None,
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] = default_forward,
) -> Callable[[torch.nn.Module, Mapping[str, Any]], PreferenceOutput]:
    """`forward(model, micro_batch) -> PreferenceOutput`: the reference's log-probs (`reference(model,
    micro_batch)`, first: its activations are freed before the policy's graph is built; skipped when
    `reference` is None, as for simpo), then the policy's logits through `forward`."""

    def dpo_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> PreferenceOutput:
        reference_logps = reference(model, micro_batch) if reference is not None else None
        return PreferenceOutput(output_logits(forward(model, micro_batch)), reference_logps)

    return dpo_forward


def _mean_logits(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, pairs: int) -> tuple:
    """TRL 1.16's "logits/chosen" and "logits/rejected": the vocabulary-mean of the logits at each
    completion position, averaged over the chosen (rejected) completion tokens of the micro-batch
    (0 when there are none). Summed in float32 without a float32 copy of the logits."""
    with torch.no_grad():
        valid = (labels[:, 1:] != ignore_index).float()
        per_position = logits.detach()[:, :-1].sum(-1, dtype=torch.float32) / logits.shape[-1]
        sums, counts = (per_position * valid).sum(-1), valid.sum(-1)
        return tuple(
            part_sums.sum() / part_counts.sum().clamp(min=1)
            for part_sums, part_counts in zip(sums.split(pairs), counts.split(pairs), strict=True)
        )


def _preference_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    mean_logits: tuple,
) -> dict[str, torch.Tensor]:
    """TRL's metric names, each a detached 0-d float32 tensor: a mean over the micro-batch's pairs
    (logits/*: over its completion tokens, as TRL 1.16)."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
        "logits/chosen": mean_logits[0],
        "logits/rejected": mean_logits[1],
    }


def make_dpo_loss(
    config: DPOConfig, ignore_index: int = IGNORE_INDEX
) -> Callable[[PreferenceOutput, Mapping[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """`loss_fn(output, micro_batch) -> (loss, metrics)`: the mean over the micro-batch's pairs of
    `dpo_loss`, and TRL's metrics (rewards/chosen, rewards/rejected, rewards/accuracies,
    rewards/margins, logps/chosen, logps/rejected, logits/chosen, logits/rejected; simpo's logps/* are
    per-token averages, as CPOTrainer logs them). `output` is a `PreferenceOutput`; the micro-batch's
    2B rows are its B chosen then B rejected completions. No host sync.

    Combine this loss over micro-batches with the step's "mean" weighting: it is a mean over pairs,
    not over tokens."""
    config.validate()

    def dpo_loss_fn(
        output: PreferenceOutput, micro_batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        labels, logits = micro_batch["labels"], full_logits(output.logits)
        logps, lengths = completion_logps(logits, labels, ignore_index)
        rows = logps.shape[0]
        if rows % 2:
            raise ValueError(
                f"a preference micro-batch holds chosen and rejected rows in pairs, got {rows} rows"
            )
        pairs = rows // 2
        reference = output.reference_logps if config.needs_reference else None
        if config.needs_reference and (reference is None or tuple(reference.shape) != (rows,)):
            got = None if reference is None else tuple(reference.shape)
            raise ValueError(
                f"dpo.loss_type {config.loss_type!r} needs the reference log-probs of the {rows} rows "
                f"(make_dpo_forward with a reference), got {got}"
            )
        ref_chosen, ref_rejected = reference.split(pairs) if reference is not None else (None, None)
        chosen, rejected = logps.split(pairs)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, lengths, config
        )
        if config.loss_type == "simpo":
            chosen, rejected = _length_normalised(chosen, rejected, lengths)
        mean_logits = _mean_logits(logits, labels, ignore_index, pairs)
        metrics = _preference_metrics(chosen_rewards, rejected_rewards, chosen, rejected, mean_logits)
        return losses.mean(), metrics

    return dpo_loss_fn


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every `torch.nn.Dropout` in `model` with p = 0 (TRL's DPOTrainer does this to the policy and the
    reference by default, so their log-probs are deterministic and the reference's match the policy's
    at step 0). Functional dropout a model reads from its config (attention_dropout) is untouched, as
    in TRL; it is off in eval mode anyway. Returns `model`."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model
