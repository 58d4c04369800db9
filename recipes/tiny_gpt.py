"""Tiny GPT: a byte-level decoder-only transformer trained on bundled Shakespeare.

    python -m recipes.tiny_gpt --run-dir runs/tiny --train.train-iters 200
    python -m recipes.tiny_gpt --help

The recipe only composes fntrain's builders in the fixed order [S1]: runtime -> model -> loss ->
data -> plan -> optimizer -> schedule -> hooks -> train.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from fntrain import RunPlan, TrainState, make_run_plan, train
from fntrain.components import Components
from fntrain.data.pipeline import DataSpec, build_data, data_fn
from fntrain.data.tokens import count_batch
from fntrain.hooks.memory import MemoryConfig, memory_hook
from fntrain.optim import OptimizerConfig, ScheduleConfig, build_lr_schedule, build_optimizer
from fntrain.runtime import Runtime
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.step import causal_lm_loss, make_train_step

CORPUS = Path(__file__).parent / "data" / "shakespeare.txt"
log = logging.getLogger("recipes.tiny_gpt")


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
    """Byte vocabulary."""


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split."""

    path: str | None = None
    """Text file to train on (None: the bundled Shakespeare corpus)."""
    val_fraction: float = 0.02
    """Tail fraction of the corpus held out for validation."""
    shuffle: bool = True
    """Shuffle the sample order each epoch (seeded by seed and epoch)."""


@dataclass(frozen=True)
class TrainConfig:
    """Run length and batch shape."""

    train_iters: int | None = 400
    """Optimizer steps to run (exclusive with train_samples)."""
    train_samples: int | None = None
    """Samples to train on; train_iters = train_samples // global_batch_size."""
    global_batch_size: int = 32
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 16
    """Sequences per forward/backward."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this (0 disables clipping)."""
    loss_weighting: Literal["token", "mean"] = "token"
    """token: token-weighted global mean; mean: plain mean over micro-batches and ranks."""


@dataclass(frozen=True)
class TinyGPTConfig:
    """Train a byte-level GPT on Shakespeare."""

    run_dir: str = "runs/tiny_gpt"
    """Directory for the resolved config, metrics.jsonl and artifacts."""
    seed: int = 42
    """Seed for initialisation and data order."""
    log_every: int = 10
    """Log metrics every N steps (0 = never)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=3e-3, weight_decay=0.1))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=20))
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Allocator-history snapshots and peak-memory logs; a relative save_path is under run_dir."""

    def validate(self) -> None:
        """Value rules, each error naming the dotted field; runs before any model or device work."""
        from fntrain.config import require_float, require_int, require_str

        require_str("run_dir", self.run_dir, non_empty=True)
        require_int("seed", self.seed, min=0)
        require_int("log_every", self.log_every, min=0)
        self.runtime.validate("runtime")
        for name in ("context", "n_layer", "n_head", "d_model"):
            require_int(f"model.{name}", getattr(self.model, name), min=1)
        if self.model.d_model % self.model.n_head:
            raise ValueError(
                f"model.d_model ({self.model.d_model}) must be divisible by model.n_head ({self.model.n_head})"
            )
        require_float("model.dropout", self.model.dropout, min=0.0, max=1.0)
        require_float("data.val_fraction", self.data.val_fraction, min=0.0, max=0.5)
        require_int("train.global_batch_size", self.train.global_batch_size, min=1)
        require_int("train.micro_batch_size", self.train.micro_batch_size, min=1)
        require_float("train.max_grad_norm", self.train.max_grad_norm, min=0.0)
        self.optim.validate("optim")
        self.schedule.validate("schedule")
        self.memory.validate("memory")


# ----------------------------------------------------------------------------- model (nanoGPT-style)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


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
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.drop(self.tok(input_ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------- data


class ByteChunks(torch.utils.data.Dataset):
    """Non-overlapping `context`-byte windows of a byte tensor; labels equal the inputs (shifted in the loss)."""

    def __init__(self, data: torch.Tensor, context: int):
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.data) // self.context

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = self.data[index * self.context : (index + 1) * self.context].long()
        return {"input_ids": chunk, "labels": chunk}


def build_datasets(config: TinyGPTConfig) -> tuple[ByteChunks, ByteChunks]:
    """(train, validation): the corpus as bytes, its tail `val_fraction` held out."""
    path = Path(config.data.path) if config.data.path else CORPUS
    if not path.is_file():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    split = int(len(raw) * (1.0 - config.data.val_fraction))
    return ByteChunks(raw[:split], config.model.context), ByteChunks(raw[split:], config.model.context)


# ----------------------------------------------------------------------------- composition


@dataclass(frozen=True)
class Built:
    """Everything the recipe built, for hooks and tests."""

    config: TinyGPTConfig
    runtime: Runtime
    plan: RunPlan
    components: Components
    data: DataSpec
    val_dataset: Any
    run_dir: Path


def build_memory_hook(config: TinyGPTConfig, runtime: Runtime) -> Any:
    """The memory hook [S35], a relative save_path resolved under run_dir. `run` builds it before the
    model, so a device without allocator history fails before any model work [S9]."""
    memory = config.memory
    save_path = os.path.expanduser(memory.save_path)
    if not os.path.isabs(save_path):
        run_dir = os.path.expanduser(config.run_dir)
        memory = dataclasses.replace(memory, save_path=os.path.join(run_dir, save_path))
    return memory_hook(memory, runtime)


def build_hooks(built: Built, *, memory: Any = None) -> list[Any]:
    """The hook list in dispatch order [S27]: memory, throughput, metrics, progress, evaluate, gc,
    profiler, checkpoint. `memory` is the hook from `build_memory_hook` when already built."""
    hooks: list[Any] = [memory if memory is not None else build_memory_hook(built.config, built.runtime)]
    return hooks


def build(config: TinyGPTConfig, runtime: Runtime) -> Built:
    """Build model, loss, data, plan, optimizer and schedule, in that order [S1]."""
    torch.manual_seed(config.seed)
    model = TinyGPT(config.model).to(runtime.device)
    train_set, val_set = build_datasets(config)
    plan = make_run_plan(
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=config.train.micro_batch_size,
        dp_size=runtime.dp_size,
        train_iters=config.train.train_iters,
        train_samples=config.train.train_samples,
        dataset_len=len(train_set),
        lr_schedule_iters=config.schedule.lr_schedule_iters,
    )
    data = build_data(
        train_set,
        micro_batch_size=config.train.micro_batch_size,
        micro_batches=plan.micro_batches,
        shuffle=config.data.shuffle,
        seed=config.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
    )
    optimizer = build_optimizer(config.optim, model).optimizer
    schedule = build_lr_schedule(config.schedule, plan, optimizer).scheduler
    components = Components(model=model, loss_fn=causal_lm_loss, optimizers=(optimizer,), schedulers=(schedule,))
    return Built(config, runtime, plan, components, data, val_set, Path(config.run_dir).expanduser())


def write_resolved_config(config: TinyGPTConfig, run_dir: Path) -> None:
    """The resolved config, effective seed included, as JSON in the run directory [S2]."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2, sort_keys=True))


def run(config: TinyGPTConfig, state: TrainState | None = None) -> TrainState:
    """Validate, build, train; return the final `TrainState`."""
    config.validate()
    runtime_config = dataclasses.replace(config.runtime, seed=config.seed)
    with setup_runtime(runtime_config) as runtime:
        memory = build_memory_hook(config, runtime)
        built = build(config, runtime)
        if runtime.is_main:
            write_resolved_config(config, built.run_dir)
        components = built.components
        step_fn = make_train_step(
            components.model,
            components.loss_fn,
            components.optimizers,
            components.schedulers,
            max_grad_norm=config.train.max_grad_norm,
            loss_weighting=config.train.loss_weighting,
            device=runtime.device,
            dp_size=runtime.dp_size,
        )
        hooks = build_hooks(built, memory=memory)
        return train(
            state or TrainState(),
            step_fn,
            hooks,
            data=data_fn(built.data),
            plan=built.plan,
            count_batch=count_batch,
        )


def main(argv: list[str] | None = None) -> TrainState:
    import tyro

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = tyro.cli(TinyGPTConfig, args=argv, description=__doc__)
    return run(config)


if __name__ == "__main__":
    main()
