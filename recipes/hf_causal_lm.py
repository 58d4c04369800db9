"""Fine-tune a local Hugging Face causal LM on text, prompt/completion or chat JSONL.

    fntrain run hf_causal_lm --model.path ./my-llama --data.path chat.jsonl --train.train-iters 100
    torchrun --nproc_per_node 2 -m fntrain run hf_causal_lm ... --parallel.strategy fsdp2
    fntrain plan hf_causal_lm --model.path ./my-llama --data.path chat.jsonl --world-size 8

Needs the `hf` extra (transformers, tokenizers). Never downloads anything: `--model.path` is a local
directory holding config.json and safetensors weights (what `save_pretrained` writes). The fine-tuned
model, its config and the tokenizer are saved to `--output-dir` in the same layout, so
`AutoModelForCausalLM.from_pretrained(output_dir)` loads the result.

Data (one JSON object per line): {"text": ...} trains on every token; {"prompt": ..., "completion": ...}
and {"messages": [{"role": ..., "content": ...}, ...]} (the tokenizer's chat template, or
`--assets.chat-template`) train on the completion / the assistant turns only. Examples are one per
sample, each micro-batch padded to its longest rounded up to a multiple of 8 (`--data.pad-to
max_length`: every one to `--data.max-length`, static shapes), or packed into windows with
`--data.packing` (each example attends only to itself). Continued pretraining: `--data.shards DIR`
(token shards `fntrain tokenize --tokenizer MODEL_DIR` wrote) instead of `--data.path`, windows of
`--data.max-length` tokens, every token trained on. A validation split (`--data.val-fraction`,
`--data.val-path`) is evaluated at the end and every tenth of the run unless `--evaluate.*` says when.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fntrain.config import require_float, require_int, require_str
from fntrain.data.sft import SFTDataConfig, build_sft_datasets
from fntrain.data.sft_collate import make_sft_collate
from fntrain.data.shards import TokenWindows, check_shard_vocab, require_shards, split_windows
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.sample import whole_logits_on_each_rank
from fntrain.models.generate import text_sampler
from fntrain.models.hf import causal_lm_from_config, check_vocab, load_assets, load_causal_lm, save_hf_model
from fntrain.models.hf_config import (
    AssetsConfig,
    HFModelConfig,
    check_packed_attention,
    check_tensor_parallel,
    model_vocab_size,
)
from fntrain.models.hf_tp import hf_tensor_parallel
from fntrain.models.lora import (
    LoraConfig,
    apply_lora,
    check_lora_parallel,
    check_lora_targets,
    save_adapter_or_merged,
)
from fntrain.models.moe import loss_with_router_aux
from fntrain.models.moe_hf import router_aux_forward
from fntrain.models.moe_hf_ep import check_expert_parallel, enable_expert_parallel
from fntrain.run.config import ExportingJobConfig, RecipeSpec, TrainConfig, require_validation
from fntrain.runtime.materialize import build_on_meta
from fntrain.step.optim import OptimizerConfig, ScheduleConfig


@dataclass(frozen=True)
class DataConfig(SFTDataConfig):
    """JSONL examples (data.path), or token shards for continued pretraining (data.shards)."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = (*SFTDataConfig.PATH_FIELDS, "shards")

    shards: str | None = None
    """Token-shard directory `fntrain tokenize` wrote with the model's tokenizer, instead of data.path: windows of max_length tokens, every token trained on (val_fraction: the held-out tail)."""

    def validate(self, prefix: str = "data") -> None:
        require_str(f"{prefix}.shards", self.shards, optional=True, non_empty=True)
        if self.shards is None and not self.path:
            raise ValueError(f"{prefix}.path is required: a JSONL file of training examples (or {prefix}.shards)")
        if self.shards is None:
            return super().validate(prefix)
        for name, value in (("path", self.path), ("val_path", self.val_path), ("packing", self.packing)):
            if value:
                raise ValueError(f"{prefix}.{name} does not apply to {prefix}.shards: unset one of them")
        require_int(f"{prefix}.max_length", self.max_length, min=2)
        require_float(f"{prefix}.val_fraction", self.val_fraction, min=0.0, max=0.5)
        require_shards(f"{prefix}.shards", self.shards)

    @property
    def has_validation(self) -> bool:
        return bool(self.val_path or self.val_fraction > 0)


@dataclass(frozen=True)
class Config(ExportingJobConfig):
    """Fine-tune a local Hugging Face causal LM and save it in save_pretrained layout."""

    run_dir: str = "runs/hf_causal_lm"
    """Directory for the resolved config, metrics, logs, checkpoints and artifacts."""
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(train_iters=100, global_batch_size=8, micro_batch_size=2)
    )
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=2e-5, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=0, min_lr_ratio=0.1))
    model: HFModelConfig = field(default_factory=HFModelConfig)
    assets: AssetsConfig = field(default_factory=AssetsConfig)
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(with_validation=True))
    """Validation loss on the validation split (data.val_fraction, data.val_path): with one and no cadence set, at the end and every tenth of the run."""
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters through peft (lora.rank > 0; the `lora` extra): only the adapters train, and output_dir receives the adapter (PEFT layout) or, with lora.merge_on_export, the merged model."""

    def validate(self) -> None:
        super().validate()
        check_packed_attention(self.model, self.data.packing)
        check_lora_parallel(self.lora, self.parallel.meta_init, tp_size=self.parallel.tp_size)
        check_tensor_parallel(self.model, self.parallel.tp_size)
        check_expert_parallel(self.model.path, self.parallel.ep_size, lora=self.lora.enabled)
        require_validation(self, self.data.has_validation, "set data.val_path or data.val_fraction > 0")


def build_assets(config: Config) -> Any:
    """The tokenizer (and its chat template); its vocabulary must fit the model's."""
    return check_vocab(config.model, load_assets(config.model, config.assets))


def model_factory(config: Config) -> Any:
    """The bare model from its config.json (no weights), for counting FLOPs on the meta device; under
    parallel.ep_size > 1 with its experts modules ep-aware, so `plan` counts them as experts."""
    model = causal_lm_from_config(config.model)
    return _enable_expert_parallel(model) if config.parallel.ep_size > 1 else model


def check(config: Config, assets: Any) -> None:
    """Before any weight is loaded: the model directory builds (on the meta device), names the
    layers LoRA is to adapt and under ep has experts modules ep supports; token shards hold only ids
    of the model's vocabulary."""
    targets = config.lora.target_modules if config.lora.enabled else ()
    check_lora_targets(lambda: model_factory(config), targets)
    if config.parallel.ep_size > 1:  # experts modules of a layout the ep forward computes
        build_on_meta(lambda: model_factory(config))
    if config.data.shards:
        check_shard_vocab("data.shards", config.data.shards, model_vocab_size(config.model))


def build_datasets(config: Config, assets: Any) -> tuple[Any, Any]:
    """(train, validation or None): the SFT examples, or windows of max_length tokens over the shards
    (stride max_length - 1: every token after a window's first is a target exactly once)."""
    if not config.data.shards:
        return build_sft_datasets(config.data, assets)
    windows = TokenWindows(config.data.shards, config.data.max_length, stride=config.data.max_length - 1)
    train, val = split_windows(windows, config.data.val_fraction)
    return train, (val if len(val) else None)


def build_model(config: Config, runtime: Any) -> Any:
    """The loaded model, with LoRA adapters (seeded by `seed`) when lora.rank > 0, parallelized; under
    parallel.ep_size > 1 its experts modules take part in expert parallelism (fntrain.models.moe_hf_ep)."""
    wrap = (lambda model: apply_lora(model, config.lora, seed=config.seed)) if config.lora.enabled else None
    if config.parallel.ep_size > 1:  # validate refused LoRA with ep: the two wraps never meet
        wrap = _enable_expert_parallel
    return load_causal_lm(config.model, runtime, config.parallel, wrap=wrap)


def _enable_expert_parallel(model: Any) -> Any:
    """`model` with its experts modules ep-aware; a ValueError when it has none this forward computes."""
    if not enable_expert_parallel(model):
        raise ValueError(f"parallel.ep_size: {type(model).__name__} has no experts modules ep supports")
    return model


def export(config: Config, built: Any, state: Any) -> Path:
    """The fine-tuned model (or LoRA adapter) and its tokenizer in save_pretrained layout (every rank
    takes part)."""
    if config.lora.enabled:
        return save_adapter_or_merged(built.components.model, config.lora, config.output_path(), built.runtime,
                                      built.assets)  # fmt: skip
    return save_hf_model(built.components.model, built.assets, config.output_path(), built.runtime)


def sampler(config: Config, built: Any) -> Any:
    """Samples during training (`--sample.*`) from the model being trained, its tokenizer and end ids,
    as `fntrain generate` samples its export; None where no rank has the whole logits."""
    if not whole_logits_on_each_rank(config.parallel):
        return None
    model = built.components.model
    return text_sampler(getattr(model, "module", model), built.assets.tokenizer, built.assets.eos_id)


spec = RecipeSpec(
    config=Config,
    build_model=build_model,
    build_assets=build_assets,
    build_datasets=build_datasets,
    collate=lambda config, assets: make_sft_collate(
        assets.pad_id, max_length=config.data.max_length, pad_to=config.data.pad_to,
        pad_multiple=config.data.pad_multiple,
    ),
    forward=router_aux_forward,  # a MoE model's router loss joins the trained loss (fntrain.models.moe_hf)
    loss=loss_with_router_aux,
    model_factory=model_factory,
    check=check,
    export=export,
    tensor_parallel=hf_tensor_parallel,
    sampler=sampler,
    describe=lambda config: {
        "strategy": config.parallel.strategy,
        "packing": config.data.packing,
        "shards": config.data.shards,
        "max_length": config.data.max_length,
        "lora_rank": config.lora.rank,
        "output_dir": str(config.output_path()),
    },
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
