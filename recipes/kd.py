"""Distil a frozen teacher into a smaller local Hugging Face causal LM (knowledge distillation).

    fntrain run kd --model.path ./small --kd.teacher-path ./big --data.path chat.jsonl --train.train-iters 100
    torchrun --nproc_per_node 2 -m fntrain run kd ... --parallel.strategy fsdp2

The student trains on `hf_causal_lm`'s data (text, prompt/completion or chat JSONL, tables, packing,
token shards) with loss = (1 - kd.ratio) * cross-entropy + kd.ratio * forward KL from the teacher at
kd.temperature, as torchtune's KD recipe defines it (`fntrain.step.objectives.kd`); the log holds both
parts as `kd/ce` and `kd/kl`. The teacher (any local causal-LM directory with the student's vocabulary,
possibly larger) is loaded frozen, sharded like the student, and runs under no_grad. The student is saved
to `--output-dir` in save_pretrained layout, like `hf_causal_lm`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fntrain.models.frozen import check_companion, load_frozen_causal_lm
from fntrain.models.hf import causal_lm_from_config
from fntrain.models.hf_config import HFModelConfig
from fntrain.step.objective import Objective, ObjectiveSpec
from fntrain.step.objectives import KDConfig, make_kd_forward, make_kd_loss

from . import hf_causal_lm


@dataclass(frozen=True)
class Config(hf_causal_lm.Config):
    """Distil a frozen teacher into a local Hugging Face causal LM and save it in save_pretrained layout."""

    run_dir: str = "runs/kd"
    """Directory for the resolved config, metrics, logs, checkpoints and artifacts."""
    kd: KDConfig = field(default_factory=KDConfig)


def teacher_model(config: Config) -> HFModelConfig:
    """The teacher's model settings: kd.teacher_path, in kd.teacher_dtype (default: model.dtype)."""
    return dataclasses.replace(config.model, path=config.kd.teacher_path, dtype=config.kd.teacher_dtype or config.model.dtype)


def check(config: Config, assets: Any) -> None:
    """`hf_causal_lm`'s checks, and the teacher: a causal LM with the student's vocabulary."""
    hf_causal_lm.check(config, assets)
    check_companion("kd.teacher_path", config.kd.teacher_path, config.model, assets)


def build_objective(config: Config, built: Any) -> Objective:
    """The student's forward beside the frozen teacher's (no_grad), and the distillation loss."""
    teacher = load_frozen_causal_lm(teacher_model(config), built.runtime, config.parallel)
    return Objective(make_kd_forward(teacher), make_kd_loss(config.kd))


spec = dataclasses.replace(
    hf_causal_lm.spec,
    config=Config,
    check=check,
    objective=ObjectiveSpec(
        name="distillation",
        build=build_objective,
        parallel=("tp",),
        frozen_model=lambda config: causal_lm_from_config(teacher_model(config)),
        forward_only=lambda config: causal_lm_from_config(teacher_model(config)),  # the teacher, every micro-batch
    ),
    describe=lambda config: {
        **hf_causal_lm.spec.describe(config),
        "objective": f"kd (ratio {config.kd.ratio}, temperature {config.kd.temperature})",
        "teacher": config.kd.teacher_path,
    },
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
