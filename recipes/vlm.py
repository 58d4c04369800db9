"""Fine-tune a local image-text-to-text model (LLaVA-style) on image + chat JSONL.

    fntrain run vlm                                  # the tiny built-in LLaVA on generated shapes
    fntrain run vlm --model.path ./my-llava --data.path vqa.jsonl --data.val-fraction 0.05
    torchrun --nproc_per_node 2 -m fntrain run vlm ... --parallel.strategy fsdp2

Needs the `vlm` extra (transformers, tokenizers, Pillow). Never downloads anything: `--model.path` is a
local directory holding the model and its processor as save_pretrained writes them
(`AutoModelForImageTextToText`, `AutoProcessor`). With no `--model.path` a tiny LLaVA (small CLIP vision
tower + small Llama, a word-level tokenizer and an image processor built from config) is written to
`--model.cache-dir` on first use, and with no `--data.path` it learns a generated set: coloured shapes
on noise, asked "What colour is the shape?" or "What shape is it?". Validation reports `val_accuracy`
(greedy answers to held-out images) beside `val_loss`.

Rows: {"image": PATH, "messages": [...]} or {"image": PATH, "prompt": ..., "completion": ...}; images
are read with Pillow and processed by the model's own processor; only assistant turns are trained on.
The fine-tuned model and processor are saved to `--output-dir` (default <run_dir>/hf_model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fntrain.config import require_int
from fntrain.data.files import count_rows
from fntrain.data.shapes import shapes_texts
from fntrain.data.vlm import VLMDataConfig, build_vlm_datasets, make_vlm_collate
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.models.vlm import (
    VLMModelConfig,
    answer_accuracy,
    load_processor,
    load_vlm,
    resolve_model_dir,
    save_vlm,
    vlm_forward,
    vlm_from_config,
)
from fntrain.run.config import ExportingJobConfig, RecipeSpec, TrainConfig, require_validation
from fntrain.step.optim import OptimizerConfig, ScheduleConfig


@dataclass(frozen=True)
class Config(ExportingJobConfig):
    """Fine-tune a local image-text-to-text model (or the tiny built-in LLaVA) on images and chat."""

    run_dir: str = "runs/vlm"
    """Directory for the resolved config, metrics, logs, checkpoints and artifacts."""
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(train_iters=300, global_batch_size=16, micro_batch_size=8)
    )
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=3e-3, weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=20, min_lr_ratio=0.1))
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(eval_every=100, at_end=True))
    """Validation loss and answer accuracy on the held-out split."""
    answer_tokens: int = 2
    """Tokens generated greedily per held-out question for val_accuracy (0: no accuracy)."""
    model: VLMModelConfig = field(default_factory=VLMModelConfig)
    data: VLMDataConfig = field(default_factory=VLMDataConfig)

    FREE_FIELDS: ClassVar[tuple[str, ...]] = (*ExportingJobConfig.FREE_FIELDS, "answer_tokens", "model.cache_dir")

    def validate(self) -> None:
        super().validate()
        require_int("answer_tokens", self.answer_tokens, min=0)
        if self.data.path and not self.model.path:
            raise ValueError("data.path needs model.path: the tiny built-in model only knows the generated set")
        if self.parallel.meta_init:
            raise ValueError("parallel.meta_init is not supported by the vlm recipe: leave it off")
        if self.data.path:
            require_validation(self, bool(self.data.val_path or self.data.val_fraction > 0),
                               "set data.val_path or data.val_fraction > 0")
        else:
            require_validation(self, self.data.val_samples > 0, "set data.val_samples > 0")


def model_dir(config: Config) -> Path:
    """model.path, or the tiny built-in LLaVA (built under model.cache_dir on first use)."""
    return resolve_model_dir(config.model, shapes_texts())


def dataset_sizes(config: Config) -> tuple[int, int]:
    """(train, validation) rows without processing any image."""
    data = config.data
    if not data.path:
        return data.train_samples, data.val_samples
    rows = count_rows(data.path, "data.path")
    if data.val_path:
        return rows, count_rows(data.val_path, "data.val_path")
    held = max(1, int(rows * data.val_fraction)) if data.val_fraction > 0 else 0
    return rows - held, held


def eval_metrics(config: Config, built: Any) -> Any:
    """val_accuracy: greedy answers to the held-out rows, sharded over the data-parallel ranks."""
    from fntrain.runtime.groups import data_parallel_group

    if not config.answer_tokens or built.val_dataset is None:
        return dict
    prompts, runtime = built.val_dataset.prompts(), built.runtime
    group = data_parallel_group(runtime)
    batch = config.evaluate.micro_batch_size or config.train.micro_batch_size

    def accuracy() -> dict[str, float]:
        value = answer_accuracy(
            built.components.model, built.assets, prompts, batch_size=batch,
            max_new_tokens=config.answer_tokens, runtime=runtime, group=group,
        )  # fmt: skip
        return {"val_accuracy": value}

    return accuracy


spec = RecipeSpec(
    config=Config,
    build_model=lambda config, runtime: load_vlm(
        model_dir(config), runtime, config.parallel, dtype=config.model.dtype,
        attn_implementation=config.model.attn_implementation,
    ),  # fmt: skip
    build_assets=lambda config: load_processor(model_dir(config)),
    build_datasets=lambda config, processor: build_vlm_datasets(config.data, processor, seed=config.seed),
    collate=lambda config, processor: make_vlm_collate(
        processor.tokenizer.pad_token_id or 0, max_length=config.data.max_length, pad_to=config.data.pad_to
    ),
    forward=vlm_forward,
    model_factory=lambda config: vlm_from_config(model_dir(config), config.model.attn_implementation),
    dataset_sizes=dataset_sizes,
    export=lambda config, built, state: save_vlm(
        built.components.model, built.assets, config.output_path(), built.runtime
    ),
    eval_metrics=eval_metrics,
    describe=lambda config: {
        "model": config.model.path or f"tiny built-in LLaVA (cache {config.model.cache_dir})",
        "data": config.data.path or "generated shapes",
        "strategy": config.parallel.strategy,
        "output_dir": str(config.output_path()),
    },
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
