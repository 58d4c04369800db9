"""Tiny GPT: a byte-level decoder-only transformer trained on bundled Shakespeare.

    fntrain run tiny_gpt --run-dir runs/tiny --train.train-iters 200
    fntrain run tiny_gpt --help
    fntrain tokenize my_corpus.txt --output shards && fntrain run tiny_gpt --data.shards shards

The recipe is a spec: the model, the data and the defaults. fntrain.run.job runs it (runtime, hooks,
checkpoints, evaluation, export). Copy it with `fntrain cp tiny_gpt my_gpt.py` to make it your own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fntrain.checkpoint.export import export_converted
from fntrain.config import require_float, require_int, require_str
from fntrain.data.byte_windows import byte_window_counts, byte_windows
from fntrain.data.corpora import corpus_path
from fntrain.data.shards import INDEX_NAME, TokenWindows, read_index, split_windows
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.models.gpt2 import gpt2_conversion
from fntrain.models.moe import (
    GroupedExperts,
    MoE,
    RouterOutput,
    loss_with_router_aux,
    mean_aux_loss,
    moe_layers,
    moe_step_end,
)
from fntrain.optim import OptimizerConfig, ScheduleConfig
from fntrain.run.config import JobConfig, RecipeSpec, TrainConfig
from fntrain.runtime import PipelineSplit, build_seeded_model, pipeline_group, tensor_parallel_plan
from fntrain.runtime.parallel import data_parallel_group

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape."""

    context: int = 128
    """Tokens (bytes) per sequence."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs bitwise reproducible across resumes)."""
    vocab_size: int = 256
    """Vocabulary size (bytes); with data.shards, raised to the shards' vocabulary (bytes + EOS: 257)."""
    experts: int = 0
    """Mixture of experts: routed experts per block (0: a dense MLP); tokens choose their top experts, none is dropped."""
    experts_per_token: int = 2
    """With model.experts: experts each token is routed to (top-k of the router's softmax, weights renormalised)."""
    shared_experts: int = 0
    """With model.experts: experts every token also passes through (one dense MLP of that many experts' width)."""
    expert_hidden: int = 0
    """With model.experts: hidden units of each expert's MLP (0: 4 x d_model, the dense MLP's)."""
    router_aux_loss_weight: float = 0.01
    """With model.experts: weight of the load-balancing loss (Switch/Mixtral form, 1.0 when balanced) added to the trained loss."""
    router_bias_rate: float = 0.0
    """With model.experts: DeepSeek-V3's auxiliary-loss-free balancing, the per-step update of the routing bias (0: off; e.g. 0.001)."""

    def validate(self, prefix: str = "model") -> None:
        for name in ("context", "n_layer", "n_head", "d_model", "vocab_size"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=1)
        if self.d_model % self.n_head:
            raise ValueError(f"{prefix}.d_model ({self.d_model}) must be divisible by {prefix}.n_head ({self.n_head})")
        require_float(f"{prefix}.dropout", self.dropout, min=0.0, max=1.0)
        for name in ("experts", "shared_experts", "expert_hidden"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=0)
        require_int(f"{prefix}.experts_per_token", self.experts_per_token, min=1, max=self.experts or None)
        for name in ("router_aux_loss_weight", "router_bias_rate"):
            require_float(f"{prefix}.{name}", getattr(self, name), min=0.0)


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split."""

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


# ----------------------------------------------------------------------------- model (nanoGPT-style)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q, self.k, self.v = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(3))
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape  # under tensor parallelism q, k, v hold this rank's heads only
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        # A boolean mask already holds causality (packed documents: block-diagonal causal).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)  # fmt: skip
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.experts:  # a mixture of experts instead of the MLP (fntrain.models.moe)
            self.moe = MoE(cfg.d_model, cfg.expert_hidden or 4 * cfg.d_model, cfg.experts, cfg.experts_per_token,
                           shared=cfg.shared_experts, aux_loss_weight=cfg.router_aux_loss_weight,
                           bias_rate=cfg.router_bias_rate)  # fmt: skip
            self.mlp = nn.Dropout(cfg.dropout)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model),
                nn.Dropout(cfg.dropout),
            )  # fmt: skip

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask)
        h = self.ln2(x)
        return x + self.mlp(self.moe(h) if hasattr(self, "moe") else h)


class TinyGPT(nn.Module):
    """Token + position embeddings, a stack of pre-norm blocks, a tied output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, GroupedExperts):
            module.reset_parameters()
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] (a MoE model: a `RouterOutput` holding them and, in training, the
        weighted router loss averaged over the blocks). Packed sequences (fntrain.data.packing) pass `position_ids` that restart
        at each document and a 4-D boolean `attention_mask` [batch, 1, seq, seq] (True: may attend) that
        keeps attention inside each document; a 2-D padding mask is ignored (attention stays causal)."""
        x = input_ids  # a pipeline stage after the first gets the previous stage's activations
        if self.tok is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
            x = self.drop(self.tok(input_ids) + self.pos(position_ids))
        attn_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
        for block in self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks:
            x = block(x) if attn_mask is None else block(x, attn_mask)
        x = self.head(self.ln_f(x)) if self.head is not None else x
        return RouterOutput(x, mean_aux_loss(moe_layers(self))) if self.cfg.experts else x


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


def export(config: Config, built: Any, state: Any) -> Path | None:
    """<run_dir>/hf_model: a transformers GPT-2 (a MoE model has no GPT-2 counterpart: not written)."""
    if config.model.experts:
        log.info("model.experts %d: a mixture of experts is not a GPT-2, hf_model not written", config.model.experts)
        return None
    return export_converted(built.components.model, built.run_dir / "hf_model",
                            lambda full: hf_conversion(config, full),
                            pipeline_group=pipeline_group(built.runtime))  # fmt: skip


def step_end(config: Config, built: Any) -> Any:
    """A MoE model's per-step router work and metrics (fntrain.models.moe.moe_step_end); None if dense."""
    if not config.model.experts:
        return None
    return moe_step_end(built.components.model, data_parallel_group(built.runtime))


spec = RecipeSpec(
    config=Config,
    build_model=build_model,
    build_datasets=build_datasets,
    loss=loss_with_router_aux,  # the cross-entropy, plus the router loss of a MoE model in training
    model_factory=lambda config: TinyGPT(model_config(config)),
    dataset_sizes=dataset_sizes,
    tensor_parallel=TENSOR_PARALLEL,
    pipeline=PIPELINE,
    hf_conversion=hf_conversion,
    attention_heads=lambda config: config.model.n_head,  # its attention is F.scaled_dot_product_attention
    export=export,
    step_end=step_end,
)

if __name__ == "__main__":
    from fntrain.cli import recipe_main

    recipe_main(spec)
