"""DPO's reference log-probs (`fntrain.step.objectives.reference`): a frozen copy (log 2 at step 0,
gradients only to the policy), a precomputed table looked up by pair index, the policy with its
adapter switched off (a stand-in offering peft's interface; slow tier: real peft LoRA), each module's
training mode restored."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

from fntrain.step.objectives import (
    DPOConfig,
    adapter_off_reference,
    completion_logps,
    frozen_reference,
    make_dpo_forward,
    make_dpo_loss,
    precompute_reference_logps,
    precomputed_reference,
)
from tests.step.objectives.preference_helpers import VOCAB, ToyLM, close, preference_batch, toy_model

# ----------------------------------------------------------------------------- the references


def test_frozen_copy_gives_log2_at_step_zero_and_gradients_only_to_the_policy():
    policy = toy_model()
    reference_model = copy.deepcopy(policy)
    batch = preference_batch()
    output = make_dpo_forward(frozen_reference(reference_model))(policy, batch)
    assert output.reference_logps.dtype == torch.float32 and not output.reference_logps.requires_grad
    loss, metrics = make_dpo_loss(DPOConfig())(output, batch)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx(0.0, abs=1e-7)
    assert metrics["rewards/accuracies"].item() == 0.0
    assert not reference_model.training
    loss.backward()
    assert all(p.grad is None for p in reference_model.parameters())
    assert all(p.grad is not None for p in policy.parameters())


def test_precomputed_table_matches_the_frozen_reference_by_index():
    reference_model = toy_model(seed=2)
    pairs = [preference_batch(pairs=1, seed=10 + i, index=[i]) for i in range(5)]

    def collate(items: list[dict]) -> dict:
        # Chosen rows of every pair first, then the rejected rows, as the data side lays them out.
        out = {
            key: torch.cat([item[key][:1] for item in items] + [item[key][1:] for item in items])
            for key in ("input_ids", "attention_mask", "labels")
        }
        out["index"] = torch.cat([item["index"] for item in items])
        return out

    reference_model.train()
    table = precompute_reference_logps(reference_model, pairs, collate, micro_batch_size=2, device="cpu")
    assert table.shape == (5, 2) and table.dtype == torch.float32
    assert reference_model.training  # its modes are restored
    frozen = frozen_reference(copy.deepcopy(reference_model))
    mixed = collate([pairs[3], pairs[0], pairs[4]])
    looked_up = precomputed_reference(table)(None, mixed)
    assert close(looked_up, frozen(None, mixed))
    assert close(looked_up, torch.cat([table[[3, 0, 4], 0], table[[3, 0, 4], 1]]))


def test_precomputed_table_shape_is_checked():
    with pytest.raises(ValueError, match=r"must be \(pairs, 2\), got \(4,\)"):
        precomputed_reference(torch.zeros(4))


class AdapterModel(nn.Module):
    """Offers what peft's PeftModel offers the reference (`peft_config`, `disable_adapter()`): the base
    model's logits plus an adapter's, the adapter switched off inside `disable_adapter()`."""

    def __init__(self, base: ToyLM) -> None:
        super().__init__()
        self.base = base
        self.adapter = nn.Linear(VOCAB, VOCAB)
        self.peft_config = {"default": None}
        self.adapter_on = True

    @contextlib.contextmanager
    def disable_adapter(self):
        self.adapter_on = False
        try:
            yield
        finally:
            self.adapter_on = True

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        logits = self.base(input_ids)
        return logits + self.adapter(logits) if self.adapter_on else logits


class Wrapper(nn.Module):
    """A wrapper around the adapted model (as torch.compile or a parallel wrapper puts one)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **inputs) -> torch.Tensor:
        return self.inner(**inputs)


def test_adapter_off_reference_is_the_base_model_and_restores_training_mode():
    base = toy_model(seed=4)
    expected_model = copy.deepcopy(base)
    policy = Wrapper(AdapterModel(base)).train()
    base.embed.eval()  # a module left in eval mode stays so
    batch = preference_batch()
    output = make_dpo_forward(adapter_off_reference())(policy, batch)
    expected, _ = completion_logps(expected_model(batch["input_ids"]), batch["labels"])
    assert close(output.reference_logps, expected)
    assert not output.reference_logps.requires_grad
    with_adapter, _ = completion_logps(output.logits, batch["labels"])
    assert not torch.allclose(with_adapter, expected)  # the policy's forward had its adapter on again
    assert policy.training and base.mix.training and not base.embed.training
    make_dpo_loss(DPOConfig())(output, batch)[0].backward()
    assert policy.inner.adapter.weight.grad is not None


def test_adapter_off_reference_refuses_a_model_without_adapter():
    with pytest.raises(ValueError, match="needs a LoRA model .* the policy is a ToyLM"):
        adapter_off_reference()(toy_model(), preference_batch())


@pytest.mark.slow
def test_adapter_off_reference_with_real_peft_lora():
    peft = pytest.importorskip("peft")
    base = toy_model(seed=4)
    expected_model = copy.deepcopy(base)
    torch.manual_seed(5)
    policy = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=["mix", "head"], init_lora_weights=False)
    )
    policy.train()
    policy.base_model.model.embed.eval()
    batch = preference_batch()
    reference = adapter_off_reference()(policy, batch)
    expected, _ = completion_logps(expected_model(batch["input_ids"]), batch["labels"])
    assert close(reference, expected)
    with_adapter, _ = completion_logps(policy(input_ids=batch["input_ids"]), batch["labels"])
    assert not torch.allclose(with_adapter, expected)  # the adapter was really on, and is on again
    assert policy.training and policy.base_model.model.mix.training
    assert not policy.base_model.model.embed.training
