"""The step side: what one optimizer step computes and how it is laid out over the ranks.

    components.py        Components: the torch objects a step mutates, in one frozen box
    losses.py            default_forward, causal_lm_loss: how a step calls the model, what it minimises
    settings.py          StepSettings: the step's numbers, device and process group, one frozen record
    train_step.py        make_train_step: micro-batches, token-weighted loss, clipping, optimizers, schedulers
    update.py            the end of a step both builders share: unscale, clip, optimizers, schedulers, metrics
    pipeline.py          make_pipeline_step / make_pipeline_eval: the same step through a pipeline schedule
    context_parallel.py  the forward and losses split over the cp ranks (Ulysses or torch's ring)
    layouts.py           the table of layouts (plain, pipeline, context-parallel): step, eval and checks
    optim.py             optimizer and LR-schedule builders

Importing the package loads the micro-batch step only; the other modules are imported by name.
"""

from fntrain.step.losses import causal_lm_loss, default_forward
from fntrain.step.settings import LOSS_WEIGHTINGS, NONFINITE_MODES, StepSettings
from fntrain.step.train_step import make_train_step
from fntrain.step.update import current_lr

__all__ = [
    "make_train_step",
    "StepSettings",
    "default_forward",
    "causal_lm_loss",
    "current_lr",
    "LOSS_WEIGHTINGS",
    "NONFINITE_MODES",
]
