"""Objectives beyond next-token cross-entropy, each a step's `forward` and `loss_fn` pair.

dpo.py: preference tuning (DPO, robust DPO, IPO, hinge, SimPO) with its reference log-probs
(reference.py) over summed completion log-probs (logps.py); kd.py: knowledge distillation from a
frozen teacher. A loss here returns `(loss, metrics)`: metrics are detached 0-d device tensors.
"""

from fntrain.step.objectives.dpo import (
    LOSS_TYPES,
    REFERENCES,
    DPOConfig,
    PreferenceOutput,
    disable_dropout,
    dpo_loss,
    make_dpo_forward,
    make_dpo_loss,
)
from fntrain.step.objectives.kd import KDConfig, KDOutput, forward_kl, make_kd_forward, make_kd_loss
from fntrain.step.objectives.logps import completion_logps
from fntrain.step.objectives.reference import (
    adapter_off_reference,
    frozen_reference,
    precompute_reference_logps,
    precomputed_reference,
)

__all__ = [
    "LOSS_TYPES",
    "REFERENCES",
    "DPOConfig",
    "PreferenceOutput",
    "completion_logps",
    "dpo_loss",
    "make_dpo_forward",
    "make_dpo_loss",
    "disable_dropout",
    "frozen_reference",
    "adapter_off_reference",
    "precomputed_reference",
    "precompute_reference_logps",
    "KDConfig",
    "KDOutput",
    "forward_kl",
    "make_kd_forward",
    "make_kd_loss",
]
