"""Preference-tune a local Hugging Face causal LM with DPO (or IPO, hinge, robust DPO, SimPO), as TRL does.

    fntrain run dpo --model.path ./my-llama --data.path prefs.jsonl --train.train-iters 100
    fntrain run dpo --model.path ./my-llama --data.path prefs.jsonl --lora.rank 8 --dpo.reference adapter-off
    torchrun --nproc_per_node 2 -m fntrain run dpo ... --parallel.strategy fsdp2

Data: rows of {"prompt", "chosen", "rejected"}: plain text, or TRL's conversational form (a `prompt` list
of messages, `chosen` / `rejected` lists holding the assistant turn, rendered with the tokenizer's chat
template), from JSONL, Parquet/Arrow or a `datasets.save_to_disk` folder (`fntrain.data.preference`). Each
micro-batch holds its pairs' chosen rows then their rejected rows, so one forward of the policy (and
one of the reference, under no_grad) computes both. The numbers are TRL 1.16's `DPOTrainer`'s
(`fntrain.step.objectives`): the loss is the mean over pairs (so `--train.loss-weighting mean`), and
the log holds `rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
`logps/chosen`, `logps/rejected` as means over the steps since the last log.

The reference (`--dpo.reference`): a frozen copy of the starting model (or of `--dpo.reference-path`)
sharded like the policy; with `--lora.*`, `adapter-off` uses the policy with its adapter switched off
(no second copy of the weights); `precomputed` computes every pair's reference log-probs once before
training and frees the copy. The trained policy (or its adapter) is saved to `--output-dir` in
save_pretrained layout, like `hf_causal_lm`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from fntrain.data.preference import PreferenceDataConfig, build_preference_datasets
from fntrain.data.preference_collate import make_preference_collate
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.models.frozen import check_companion, load_frozen_causal_lm
from fntrain.models.hf import causal_lm_from_config
from fntrain.models.hf_config import AssetsConfig, HFModelConfig
from fntrain.models.lora import LoraConfig, check_lora_parallel, check_lora_targets
from fntrain.run.config import ExportingJobConfig, RecipeSpec, TrainConfig, require_validation
from fntrain.runtime.precision import autocast_dtype
from fntrain.step.objective import Objective, ObjectiveSpec
from fntrain.step.objectives import (
    DPOConfig,
    adapter_off_reference,
    disable_dropout,
    frozen_reference,
    make_dpo_forward,
    make_dpo_loss,
    precompute_reference_logps,
    precomputed_reference,
)
from fntrain.step.optim import OptimizerConfig, ScheduleConfig

from . import hf_causal_lm


@dataclass(frozen=True)
class Config(ExportingJobConfig):
    """Preference-tune a local Hugging Face causal LM (DPO and variants) and save it in save_pretrained layout."""

    run_dir: str = "runs/dpo"
    """Directory for the resolved config, metrics, logs, checkpoints and artifacts."""
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(train_iters=100, global_batch_size=8, micro_batch_size=2,
                                            loss_weighting="mean")  # fmt: skip
    )
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-6, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=0, min_lr_ratio=0.0))
    model: HFModelConfig = field(default_factory=HFModelConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(with_validation=True))
    """The preference loss and rewards on the validation split (data.val_fraction, data.val_path): with one and no cadence set, at the end and every tenth of the run."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters through peft (lora.rank > 0; the `lora` extra): only the adapters train; with dpo.reference adapter-off the reference is the policy without them."""

    def validate(self) -> None:
        super().validate()
        check_lora_parallel(self.lora, self.parallel.meta_init, tp_size=self.parallel.tp_size)
        require_validation(self, bool(self.data.val_path or self.data.val_fraction > 0),
                           "set data.val_path or data.val_fraction > 0")  # fmt: skip


def check_objective(config: Config, dp_size: int) -> None:
    """DPO's rules across sections: its loss is a mean over pairs, and an adapter-off reference needs LoRA."""
    if config.train.loss_weighting != "mean":
        raise ValueError("train.loss_weighting must be 'mean' for DPO (its loss is a mean over pairs), got "
                         f"{config.train.loss_weighting!r}")  # fmt: skip
    if config.dpo.needs_reference and config.dpo.reference == "adapter-off" and not config.lora.enabled:
        raise ValueError("dpo.reference 'adapter-off' needs LoRA (lora.rank > 0): without an adapter "
                         "the policy is no reference")  # fmt: skip


def reference_model(config: Config) -> HFModelConfig | None:
    """The reference's model settings: a frozen copy of dpo.reference_path (default: model.path); None
    when the loss or the reference needs no second model (simpo, adapter-off)."""
    if not config.dpo.needs_reference or config.dpo.reference == "adapter-off":
        return None
    return dataclasses.replace(config.model, path=config.dpo.reference_path or config.model.path)


def check(config: Config, assets: Any) -> None:
    """Before any weight is loaded: LoRA's targets exist, and a reference directory of its own is a
    causal LM with the policy's vocabulary."""
    targets = config.lora.target_modules if config.lora.enabled else ()
    check_lora_targets(lambda: causal_lm_from_config(config.model), targets)
    reference = reference_model(config)
    if reference is not None and config.dpo.reference_path:
        check_companion("dpo.reference_path", reference.path, config.model, assets)


def build_datasets(config: Config, assets: Any) -> tuple[Any, Any]:
    """(train, validation or None): every row tokenized and checked before any model work."""
    return build_preference_datasets(config.data, assets)


def build_model(config: Config, runtime: Any) -> Any:
    """The policy (with LoRA adapters when lora.rank > 0), its dropout off as TRL does, parallelized."""
    return disable_dropout(hf_causal_lm.build_model(config, runtime))


def build_objective(config: Config, built: Any) -> Objective:
    """The DPO forward (policy, then the reference's log-probs) and loss over the built policy."""
    loss = make_dpo_loss(config.dpo)
    if not config.dpo.needs_reference:
        return Objective(make_dpo_forward(None), loss)
    if config.dpo.reference == "adapter-off":
        return Objective(make_dpo_forward(adapter_off_reference()), loss)
    frozen = load_frozen_causal_lm(reference_model(config), built.runtime, config.parallel)
    if config.dpo.reference == "copy":
        return Objective(make_dpo_forward(frozen_reference(frozen)), loss)
    return Objective(make_dpo_forward(_precomputed(frozen, built)), loss)


def _precomputed(frozen: Any, built: Any) -> Any:
    """The reference log-probs of every training and validation pair, computed once (under the run's
    autocast) with the frozen copy, which is then dropped. Evaluation runs the model in eval mode, the
    step in train mode: that is how the lookup tells a validation pair's index from a training one's."""
    config, device = built.config, built.runtime.device
    dtype = autocast_dtype(config.parallel)
    tables = {}
    with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        for split, dataset in (("train", built.data.dataset), ("val", built.val_dataset)):
            if dataset is not None:
                table = precompute_reference_logps(frozen, dataset, built.collate_fn, config.train.micro_batch_size,
                                                   device)  # fmt: skip
                tables[split] = precomputed_reference(table)
    train, val = tables["train"], tables.get("val")

    def reference(model: Any, micro_batch: Any) -> Any:
        return (train if model.training or val is None else val)(model, micro_batch)

    return reference


def _reference_forward(config: Config) -> Any:
    """The model whose forward runs beside the policy's on every micro-batch (for the FLOPs count): the
    frozen copy, the policy itself with its adapters off, or none (simpo; a precomputed reference)."""
    if not config.dpo.needs_reference or config.dpo.reference == "precomputed":
        return None
    if config.dpo.reference == "adapter-off":
        return causal_lm_from_config(config.model)
    return causal_lm_from_config(reference_model(config))


spec = RecipeSpec(
    config=Config,
    build_model=build_model,
    build_assets=hf_causal_lm.build_assets,
    build_datasets=build_datasets,
    collate=lambda config, assets: make_preference_collate(assets.pad_id, pad_multiple=config.data.pad_multiple),
    model_factory=lambda config: causal_lm_from_config(config.model),
    check=check,
    export=hf_causal_lm.export,
    tensor_parallel=hf_causal_lm.spec.tensor_parallel,
    sampler=hf_causal_lm.sampler,
    objective=ObjectiveSpec(
        name="dpo",
        build=build_objective,
        check=check_objective,
        parallel=("tp",),
        frozen_model=lambda config: causal_lm_from_config(ref) if (ref := reference_model(config)) else None,
        forward_only=lambda config: _reference_forward(config),
        rows_per_sample=2,  # a pair is laid out as its chosen and its rejected row
    ),
    describe=lambda config: {
        "objective": f"dpo ({config.dpo.loss_type}, beta {config.dpo.beta})",
        "reference": config.dpo.reference if config.dpo.needs_reference else "none (simpo)",
        "max_length": config.data.max_length,
        "lora_rank": config.lora.rank,
        "output_dir": str(config.output_path()),
    },
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
