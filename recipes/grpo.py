"""Online RL with verifiable rewards: GRPO (and Dr. GRPO, DAPO) on a local Hugging Face causal LM, as TRL does.

    fntrain run grpo --model.path ./my-llama --data.path problems.jsonl \
        --grpo.reward-funcs fntrain.rewards:math_accuracy fntrain.rewards:answer_format --grpo.reward-weights 1 0.2
    torchrun --nproc_per_node 2 -m fntrain run grpo ... --parallel.strategy fsdp2

Data: rows holding a `prompt` (plain text, or chat messages rendered with the tokenizer's chat template and
its generation prompt), from JSONL, Parquet/Arrow or a `datasets.save_to_disk` folder; every other column
(e.g. `answer`) goes to the reward functions (`fntrain.data.prompts`). Reward functions are named
module:function and have TRL's signature `fn(prompts, completions, completion_ids, **columns) -> list of
float or None` (`fntrain.rewards` holds two built-in ones), so TRL's reward functions drop in unchanged.

Each step trains on completions the policy samples in the step itself (`fntrain.step.objectives.grpo`):
`--grpo.num-generations` per prompt, `--train.global-batch-size` completions per optimizer step, one
generation batch per `--grpo.steps-per-generation` micro-batch steps, reused `--grpo.num-iterations`
times. Loss, advantages and metrics are TRL 1.16's GRPOTrainer's under its names (loss_type dapo and beta
0 by default). The KL reference (`--grpo.beta` > 0) is a frozen copy of the starting model, sharded like
the policy, or with `--lora.*` the policy with its adapter switched off (`--grpo.reference adapter-off`).
The trained policy (or its adapter) is saved to `--output-dir` in save_pretrained layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fntrain.config import ConfigError
from fntrain.data.prompts import PromptDataConfig, build_prompt_dataset, collate_prompts, longest_prompt
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.rollout_samples import rollout_samples_hook
from fntrain.hooks.standard_inputs import HookFactory
from fntrain.models.frozen import check_companion, load_frozen_causal_lm
from fntrain.models.hf import causal_lm_from_config, unwrap
from fntrain.models.hf_config import AssetsConfig, HFModelConfig, model_max_positions
from fntrain.models.lora import LoraConfig, check_lora_parallel, check_lora_targets
from fntrain.run.config import ExportingJobConfig, RecipeSpec, TrainConfig
from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.precision import autocast_dtype
from fntrain.step.objective import Objective, ObjectiveSpec
from fntrain.step.objectives import disable_dropout
from fntrain.step.objectives.grpo import (
    GRPOConfig,
    GRPOParts,
    check_grpo,
    generation_shape,
    grpo_objective,
    plan_lines,
)
from fntrain.step.objectives.grpo.rewards import load_reward_functions
from fntrain.step.optim import OptimizerConfig, ScheduleConfig

from . import hf_causal_lm


@dataclass(frozen=True)
class Config(ExportingJobConfig):
    """Train a local Hugging Face causal LM with GRPO on prompts and reward functions; save it in save_pretrained layout."""

    run_dir: str = "runs/grpo"
    """Directory for the resolved config, metrics, samples, logs, checkpoints and artifacts."""
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(train_iters=100, global_batch_size=16, micro_batch_size=8,
                                            loss_weighting="mean")  # fmt: skip
    )
    """Completions per optimizer step (global_batch_size) and per forward (micro_batch_size)."""
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-6, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(kind="linear", min_lr_ratio=0.0))
    model: HFModelConfig = field(default_factory=HFModelConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """GRPO has no validation loss: evaluation stays off (the rewards of each generation batch are logged instead)."""
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters through peft (lora.rank > 0; the `lora` extra): only the adapters train; with grpo.reference adapter-off the KL's reference is the policy without them."""

    def validate(self) -> None:
        super().validate()
        check_lora_parallel(self.lora, self.parallel.meta_init, tp_size=self.parallel.tp_size)
        if self.evaluate.enabled:
            raise ValueError("evaluate: GRPO has no validation loss to evaluate; leave evaluate.eval_every, "
                             "evaluate.eval_epochs and evaluate.at_end unset")  # fmt: skip


def reference_model(config: Config) -> HFModelConfig | None:
    """The KL reference's model settings: a frozen copy of grpo.reference_path (default: model.path);
    None without a KL (beta 0) or with an adapter-off reference."""
    if config.grpo.beta == 0 or config.grpo.reference == "adapter-off":
        return None
    return dataclasses.replace(config.model, path=config.grpo.reference_path or config.model.path)


def check(config: Config, assets: Any) -> None:
    """Before any weight is loaded: the reward functions import, LoRA's targets exist, and a reference
    directory of its own is a causal LM with the policy's vocabulary."""
    load_reward_functions(config.grpo.reward_funcs, "grpo.reward_funcs")
    check_lora_targets(lambda: causal_lm_from_config(config.model), config.lora.target_modules if config.lora.enabled else ())
    reference = reference_model(config)
    if reference is not None and config.grpo.reference_path:
        check_companion("grpo.reference_path", reference.path, config.model, assets)


def build_datasets(config: Config, assets: Any) -> tuple[Any, None]:
    """(prompts, None): every row read and tokenized; a prompt that leaves no room for
    grpo.max_completion_length in the model's context is refused, naming its row."""
    prompts = build_prompt_dataset(config.data, assets)
    context = model_max_positions(config.model)
    length, where = longest_prompt(prompts)
    if context is not None and length + config.grpo.max_completion_length > context:
        raise ConfigError(f"{where}: its prompt is {length} tokens, and with grpo.max_completion_length "
                          f"{config.grpo.max_completion_length} it does not fit the model's context of {context} "
                          "positions")  # fmt: skip
    return prompts, None


def build_model(config: Config, runtime: Any) -> Any:
    """The policy (with LoRA adapters when lora.rank > 0), its dropout off unless grpo.disable_dropout is false, parallelized."""
    model = hf_causal_lm.build_model(config, runtime)
    return disable_dropout(model) if config.grpo.disable_dropout else model


def build_objective(config: Config, built: Any) -> Objective:
    """GRPO over the built policy: the reward functions, the reference (a frozen copy when beta > 0), the
    tokenizer's decode and EOS ids, the run's batch shape; its samples published by a hook."""
    runtime, assets = built.runtime, built.assets
    reference = reference_model(config)
    frozen = load_frozen_causal_lm(reference, runtime, config.parallel) if reference is not None else None
    if frozen is not None and config.grpo.disable_dropout:
        disable_dropout(frozen)
    policy = built.components.model
    generation_eos = getattr(getattr(unwrap(policy), "generation_config", None), "eos_token_id", None)
    eos_ids = {assets.eos_id} if assets.eos_id is not None else set()
    eos_ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos is not None else [])
    objective, phase = grpo_objective(config.grpo, GRPOParts(
        policy=policy, reference=frozen,
        decode_text=lambda ids: assets.tokenizer.decode(ids, skip_special_tokens=True),
        pad_id=assets.pad_id, eos_ids=tuple(sorted(eos_ids)),
        reward_functions=load_reward_functions(config.grpo.reward_funcs, "grpo.reward_funcs"),
        seed=config.seed, micro_batch_size=config.train.micro_batch_size, micro_batches=built.plan.micro_batches,
        device=runtime.device, autocast_dtype=autocast_dtype(config.parallel), dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size, dp_group=data_parallel_group(runtime), sharded=config.parallel.strategy == "fsdp2",
    ))  # fmt: skip
    samples = HookFactory(lambda inputs, wiring: rollout_samples_hook(phase.take_samples, runtime, built.run_dir,
                                                                      wiring.writer))  # fmt: skip
    return dataclasses.replace(objective, hooks=(*objective.hooks, samples))


spec = RecipeSpec(
    config=Config,
    build_model=build_model,
    build_assets=hf_causal_lm.build_assets,
    build_datasets=build_datasets,
    collate=lambda config, assets: collate_prompts,
    model_factory=lambda config: causal_lm_from_config(config.model),
    check=check,
    export=hf_causal_lm.export,
    tensor_parallel=hf_causal_lm.spec.tensor_parallel,
    sampler=hf_causal_lm.sampler,
    objective=ObjectiveSpec(
        name="grpo",
        build=build_objective,
        check=check_grpo,
        generation=generation_shape,
        frozen_model=lambda config: causal_lm_from_config(ref) if (ref := reference_model(config)) else None,
        plan=plan_lines,
    ),
    describe=lambda config: {
        "model": config.model.path,
        "reward_funcs": list(config.grpo.reward_funcs),
        "lora_rank": config.lora.rank,
        "output_dir": str(config.output_path()),
    },
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
