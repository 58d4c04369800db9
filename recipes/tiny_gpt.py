"""Tiny GPT: a byte-level decoder-only transformer trained on bundled Shakespeare.

    fntrain run tiny_gpt --run-dir runs/tiny --train.train-iters 200
    fntrain run tiny_gpt --help
    fntrain tokenize my_corpus.txt --output shards && fntrain run tiny_gpt --data.shards shards

The recipe is a spec: the model (fntrain.models.gpt's `TinyGPT`, with its parallel plans here), the data
and the defaults. fntrain.run.job runs it (runtime, hooks, checkpoints, evaluation, export). Copy it with
`fntrain cp tiny_gpt my_gpt.py` to make it your own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn

from fntrain.checkpoint.export import export_converted
from fntrain.config import require_float, require_str
from fntrain.data.byte_windows import byte_window_counts, byte_windows
from fntrain.data.corpora import corpus_path
from fntrain.data.shard_index import INDEX_NAME, read_index
from fntrain.data.shards import TokenWindows, split_windows
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.sample import SampleConfig, whole_logits_on_each_rank
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.models.gpt2 import gpt2_conversion
from fntrain.models.moe import loss_with_router_aux, moe_step_end
from fntrain.models.tokenizer_files import text_tokenizer
from fntrain.run.config import CheckpointConfig, HFConversion, JobConfig, RecipeSpec, TrainConfig
from fntrain.runtime import PipelineSplit, build_seeded_model, pipeline_group, tensor_parallel_plan
from fntrain.runtime.groups import data_parallel_group
from fntrain.sampling import SampleSettings, sample_tokens
from fntrain.step.optim import OptimizerConfig, ScheduleConfig

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("path", "shards")

    path: str | None = None
    """Text file to train on (None: the bundled Shakespeare corpus, unless data.shards is set)."""
    shards: str | None = None
    """Token-shard directory written by `fntrain tokenize`, read memory-mapped (instead of data.path)."""
    val_fraction: float = 0.02
    """Tail fraction of the corpus held out for validation."""

    def validate(self, prefix: str = "data") -> None:
        require_str(f"{prefix}.path", self.path, optional=True, non_empty=True)
        if self.path is not None and not Path(self.path).expanduser().exists():
            raise FileNotFoundError(f"{prefix}.path {self.path!r} does not exist")
        require_str(f"{prefix}.shards", self.shards, optional=True, non_empty=True)
        if self.path is not None and self.shards is not None:
            raise ValueError(f"{prefix}.path and {prefix}.shards exclude each other: set one of them")
        if self.shards is not None and not (Path(self.shards).expanduser() / INDEX_NAME).is_file():
            raise FileNotFoundError(f"{prefix}.shards {self.shards!r} holds no fntrain tokenize output")
        require_float(f"{prefix}.val_fraction", self.val_fraction, min=0.0, max=0.5)


@dataclass(frozen=True)
class Config(JobConfig):
    """Train a byte-level GPT on Shakespeare."""

    run_dir: str = "runs/tiny_gpt"
    """Directory for the resolved config, metrics.jsonl, logs, checkpoints and artifacts."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(train_iters=400, global_batch_size=32))
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=3e-3, weight_decay=0.1))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=20))
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(eval_every=50, at_end=True))
    """Validation loss and perplexity on the held-out tail of the corpus."""
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(save_every=100))
    """Checkpoints every 100 steps and at the end; rerunning the command in its run_dir resumes (or says the run is complete)."""
    sample: SampleConfig = field(default_factory=lambda: SampleConfig(prompts=("ROMEO:",)))
    """Text the model writes from "ROMEO:" after the last step (and every sample.every steps): the log and <run_dir>/samples.jsonl."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> None:
        super().validate()
        if not self.data.shards and self.model.vocab_size < 256:  # byte data: every byte is a token
            raise ValueError(f"model.vocab_size must be >= 256 for byte-level data, got {self.model.vocab_size}")
        if self.model.n_head % self.parallel.tp_size:  # each tp rank holds whole heads
            raise ValueError(f"parallel.tp_size ({self.parallel.tp_size}) must divide model.n_head ({self.model.n_head})")
        if self.model.context % self.parallel.cp_size:  # each cp rank holds an equal slice of every sequence
            raise ValueError(f"--parallel.cp-size {self.parallel.cp_size} must divide --model.context, got {self.model.context}")
        _validate_moe_parallel(self.model, self.parallel)


def _validate_moe_parallel(model: ModelConfig, parallel: Any) -> None:
    """What a MoE tiny GPT combines with: expert parallelism (ep dividing the experts), not tp, pp or cp."""
    if model.experts == 0:
        if parallel.ep_size > 1:
            raise ValueError(f"parallel.ep_size {parallel.ep_size} needs a model with experts (model.experts > 0)")
        return
    for name in ("tp_size", "pp_size", "cp_size"):
        if getattr(parallel, name) > 1:
            raise ValueError(f"model.experts {model.experts} cannot be combined with parallel.{name} {getattr(parallel, name)} yet")
    if model.experts % parallel.ep_size:
        raise ValueError(f"parallel.ep_size ({parallel.ep_size}) must divide model.experts ({model.experts})")


# ----------------------------------------------------------------------------- data


def _corpus(config: Config) -> Path:
    return Path(config.data.path).expanduser() if config.data.path else corpus_path("shakespeare")


def dataset_sizes(config: Config) -> tuple[int, int]:
    """(train, validation) sample counts from the corpus file's size (or the shard index) alone."""
    if config.data.shards:
        return tuple(map(len, build_datasets(config)))  # nothing is mapped or read
    return byte_window_counts(_corpus(config), config.model.context, config.data.val_fraction)


def build_datasets(config: Config, assets: Any = None) -> tuple[Any, Any]:
    """(train, validation): the corpus as bytes (or the shards' token windows), its tail held out."""
    if config.data.shards:
        return split_windows(TokenWindows(config.data.shards, config.model.context), config.data.val_fraction)
    return byte_windows(_corpus(config), config.model.context, config.data.val_fraction)


# ----------------------------------------------------------------------------- model (fntrain.models.gpt)


def model_config(config: Config) -> ModelConfig:
    """The model's shape, its vocabulary raised to the one of data.shards."""
    vocab = read_index(config.data.shards).vocab_size if config.data.shards else None
    return replace(config.model, vocab_size=max(config.model.vocab_size, vocab or 0))


# Megatron's split: attention heads, the MLP's hidden units and the vocabulary over the tp ranks.
TENSOR_PARALLEL = tensor_parallel_plan({
    "tok": "embedding", "blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise", "head": "output",
})  # fmt: skip
PIPELINE = PipelineSplit(layers="blocks", first=("tok", "pos"), last=("ln_f", "head"))


def build_model(config: Config, runtime: Any) -> nn.Module:
    """The GPT initialised from the seed and parallelized (eagerly, or on meta with parallel.meta_init)."""
    return build_seeded_model(lambda: TinyGPT(model_config(config)), runtime, config.parallel, seed=config.seed,
                              post_init=TinyGPT._init, tensor_parallel=TENSOR_PARALLEL, pipeline=PIPELINE)  # fmt: skip


def hf_conversion(config: Config, state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tiny GPT as a transformers GPT-2 (config.json's dict, tensors), for the run's hf_model and
    `fntrain export --format hf` alike: the vocabulary is the trained embedding's, EOS the shards'."""
    if config.model.experts:
        raise ValueError(f"model.experts {config.model.experts}: a mixture of experts has no GPT-2 counterpart "
                         "(export with --recipe none for the model's own names)")  # fmt: skip
    shape = replace(config.model, vocab_size=state["tok.weight"].shape[0])
    return gpt2_conversion(state, shape, eos_id=_shards_eos(config))


def _shards_eos(config: Config) -> int | None:
    if not config.data.shards:
        return None
    try:
        return read_index(config.data.shards).eos_id
    except (OSError, ValueError):  # the shards moved since the run: the model exports without an EOS id
        return None


def hf_tokenizer(config: Config) -> Any:
    """What writes the GPT-2's tokenizer beside it: UTF-8 bytes (with the shards' EOS), or the tokenizer
    the shards were written with; None when the shards or that tokenizer cannot be read from here."""
    return text_tokenizer(config.data.shards)


def export(config: Config, built: Any, state: Any) -> Path | None:
    """<run_dir>/hf_model: a transformers GPT-2 and its tokenizer (a MoE model has no GPT-2 counterpart:
    not written)."""
    if config.model.experts:
        log.info("model.experts %d: a mixture of experts is not a GPT-2, hf_model not written", config.model.experts)
        return None
    return export_converted(built.components.model, built.run_dir / "hf_model",
                            lambda full: hf_conversion(config, full),
                            pipeline_group=pipeline_group(built.runtime), tokenizer=hf_tokenizer(config))  # fmt: skip


def step_end(config: Config, built: Any) -> Any:
    """A MoE model's per-step router work and metrics (fntrain.models.moe.moe_step_end); None if dense."""
    if not config.model.experts:
        return None
    return moe_step_end(built.components.model, data_parallel_group(built.runtime))


def sampler(config: Config, built: Any) -> Any:
    """Byte-level text from the trained model (prompt as UTF-8 bytes; bytes that do not decode: U+FFFD),
    ending at the shards' EOS; None under pipeline parallelism or a loss-parallel head (no rank holds
    the whole model or its logits: sample the checkpoint with `fntrain generate`)."""
    if not whole_logits_on_each_rank(config.parallel):
        return None
    model, device, eos_id = getattr(built.components.model, "module", built.components.model), built.runtime.device, _shards_eos(config)

    def sample(prompt: str, settings: SampleSettings, generator: torch.Generator) -> str:
        ids = torch.tensor(list(prompt.encode("utf-8")), dtype=torch.long, device=device)
        tokens = sample_tokens(model, ids, replace(settings, eos_id=eos_id), generator)
        return bytes(token for token in tokens if token < 256).decode("utf-8", errors="replace")

    return sample


spec = RecipeSpec(
    config=Config,
    build_model=build_model,
    build_datasets=build_datasets,
    loss=loss_with_router_aux,  # the cross-entropy, plus the router loss of a MoE model in training
    model_factory=lambda config: TinyGPT(model_config(config)),
    dataset_sizes=dataset_sizes,
    tensor_parallel=TENSOR_PARALLEL,
    pipeline=PIPELINE,
    hf_conversion=HFConversion(hf_conversion, hf_tokenizer),
    attention_heads=lambda config: config.model.n_head,  # its attention is F.scaled_dot_product_attention
    export=export,
    step_end=step_end,
    sampler=sampler,
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
