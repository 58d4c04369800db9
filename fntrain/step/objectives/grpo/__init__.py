"""GRPO (and Dr. GRPO, DAPO): online RL with generation in the step, numbers as TRL 1.16's GRPOTrainer.

    config.py     GRPOConfig: the settings under TRL's names
    rewards.py    reward functions named module:function, loaded and called with TRL's convention
    advantages.py group advantages (scale_rewards group, batch or none) and the reward metrics
    layout.py     which completions each rank trains on, and rows -> micro-batches
    rollout.py    the rollout: sample, score, advantages, extra log-probs, metrics (a plain function)
    phase.py      the step's rollout phase and its checkpointed state (the generation batch kept)
    loss.py       the GRPO forward (per-token log-probs, entropy) and loss (grpo, bnpo, dr_grpo, dapo)
    objective.py  the objective entry: rules, data shape, plan lines, and the built objective
"""

from fntrain.step.objectives.grpo.config import GRPOConfig
from fntrain.step.objectives.grpo.objective import (
    GRPOParts,
    check_grpo,
    generation_shape,
    grpo_objective,
    plan_lines,
)

__all__ = ["GRPOConfig", "GRPOParts", "check_grpo", "generation_shape", "grpo_objective", "plan_lines"]
