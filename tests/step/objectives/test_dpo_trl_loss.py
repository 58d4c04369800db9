"""TRL 1.16's own loss code on the same numbers as fntrain's (slow tier: importing trl takes seconds):
`DPOTrainer._compute_loss` over a stand-in trainer and fused-head outputs for sigmoid, hinge, IPO and
robust DPO (loss and every metric), `CPOTrainer.cpo_loss` for SimPO."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import DPOConfig, PreferenceOutput, make_dpo_loss
from tests.step.objectives.preference_helpers import METRIC_NAMES, PAIRS, SEQ, VOCAB, preference_batch

pytestmark = pytest.mark.slow


def _trl_trainer_stub(config: DPOConfig, policy_logps_model) -> SimpleNamespace:
    """Just what `DPOTrainer._compute_loss` reads of its trainer, with identity gathers (one process)."""
    identity = lambda x: x  # noqa: E731
    accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=identity, gather=identity, unwrap_model=identity
    )
    return SimpleNamespace(
        accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        ref_model=None, model=policy_logps_model, args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        f_divergence_type="reverse_kl", loss_types=[config.loss_type], loss_weights=[1.0], beta=config.beta,
        label_smoothing=config.label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip


class FusedOutputs(nn.Module):
    """Stands in for a model with TRL's fused LM head: per-token outputs from fixed logits."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.is_gradient_checkpointing = False

    def forward(self, labels: torch.Tensor, **_) -> SimpleNamespace:
        shifted, targets = self.logits[:, :-1], labels[:, 1:]
        mask = targets != IGNORE_INDEX
        logps = torch.log_softmax(shifted, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        zero = lambda x: x.masked_fill(~mask, 0)  # noqa: E731
        return SimpleNamespace(
            log_probs=zero(logps),
            entropy=zero(torch.zeros_like(logps)),
            mean_logits=zero(shifted.mean(-1)),
            is_top1=mask & False,
        )


@pytest.mark.parametrize(
    "config",
    [DPOConfig(beta=0.25), DPOConfig(beta=0.3, loss_type="hinge"), DPOConfig(beta=0.2, loss_type="ipo"),
     DPOConfig(beta=0.1, loss_type="robust", label_smoothing=0.2)],
    ids=lambda c: c.loss_type,
)  # fmt: skip
def test_trl_dpo_trainer_computes_the_same_loss_and_metrics(config):
    pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DPOTrainer

    batch = preference_batch()
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=torch.Generator().manual_seed(7))
    reference = torch.tensor([-9.0, -8.0, -12.0, -10.0, -7.5, -11.0])
    stub = _trl_trainer_stub(config, FusedOutputs(logits).train())
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "completion_mask": (batch["labels"] != IGNORE_INDEX).long(),
              "ref_chosen_logps": reference[:PAIRS], "ref_rejected_logps": reference[PAIRS:]}  # fmt: skip
    trl_loss = DPOTrainer._compute_loss(stub, stub.model, inputs, return_outputs=False)
    loss, metrics = make_dpo_loss(config)(PreferenceOutput(logits, reference), batch)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    trl_metrics = stub._metrics["train"]
    for name in METRIC_NAMES:
        assert metrics[name].item() == pytest.approx(trl_metrics[name][0], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_trl_cpo_trainer_simpo_computes_the_same_loss(smoothing):
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    config = DPOConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.7, label_smoothing=smoothing)
    batch = preference_batch()
    logits = torch.randn(2 * PAIRS, SEQ, VOCAB, generator=torch.Generator().manual_seed(8))
    stub = SimpleNamespace(
        alpha=0.0,
        beta=config.beta,
        loss_type="simpo",
        simpo_gamma=config.simpo_gamma,
        label_smoothing=smoothing,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    averages = CPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stub, averages[:PAIRS], averages[PAIRS:])
    loss, metrics = make_dpo_loss(config)(PreferenceOutput(logits, None), batch)
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(chosen_rewards.mean().item(), rel=1e-5)
    assert metrics["rewards/rejected"].item() == pytest.approx(rejected_rewards.mean().item(), rel=1e-5)
    assert metrics["logps/chosen"].item() == pytest.approx(averages[:PAIRS].mean().item(), rel=1e-5)
