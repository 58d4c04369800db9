"""Tiny GPT: a byte-level decoder-only transformer trained on bundled Shakespeare.

    python -m recipes.tiny_gpt --run-dir runs/tiny --train.train-iters 200
    python -m recipes.tiny_gpt --help

The recipe only composes fntrain's builders in the fixed order [S1]: runtime -> model -> loss ->
data -> plan -> optimizer -> schedule -> hooks -> train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
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
from fntrain.hooks.checkpoint import CheckpointConfig, checkpoint_root, make_preemption
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.gc import GCConfig
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.metrics import MetricsConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.standard import (
    EarlyHooks,
    early_hooks,
    memory_config,
    profiler_config,
    restore_run,
    standard_hooks,
)
from fntrain.hooks.throughput import ThroughputConfig, measure_flops_per_token
from fntrain.hooks.watchdog import WatchdogConfig
from fntrain.logs import rank_logs
from fntrain.optim import OptimizerConfig, ScheduleConfig, build_lr_schedule, build_optimizer
from fntrain.preemption import Preemption
from fntrain.run_metadata import record_start, write_run_metadata
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import (
    ParallelConfig,
    autocast_dtype,
    build_grad_scaler,
    data_parallel_group,
    hsdp_shape,
    parallel_train_step,
    parallelize,
)
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.step import causal_lm_loss

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
    num_workers: int = 0
    """DataLoader worker processes (0 reads in the training process); results do not depend on it."""
    prefetch: bool = False
    """Read the next steps' batches on a background thread; results do not depend on it."""
    prefetch_depth: int = 1
    """Steps the prefetch thread may read ahead."""
    pin_memory: bool = True
    """Page-lock host batches in the background when training on an accelerator (ignored on CPU)."""


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data parallelism (none / ddp / fsdp2 under torchrun), mixed precision, activation checkpointing, compile."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=3e-3, weight_decay=0.1))
    schedule: ScheduleConfig = field(default_factory=lambda: ScheduleConfig(warmup_iters=20))
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Allocator-history snapshots and peak-memory logs; a relative save_path is under run_dir."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints under <run_dir>/checkpoints (or checkpoint.dir): cadence, retention, async, restore, export."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """A window of steps traced with torch.profiler / torch_npu.profiler into
    <output_path>/profile/rank_<rank>/; output_path None is run_dir, a relative one is under run_dir."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where the metrics logged every log_every steps go: <run_dir>/metrics.jsonl, TensorBoard."""
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    """Step time, tokens/s, TFLOP/s and MFU (FLOPs per token measured on a meta copy of the model)."""
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    """The tqdm progress bar on rank 0."""
    evaluate: EvaluateConfig = field(default_factory=lambda: EvaluateConfig(eval_every=50, at_end=True))
    """Validation loss and perplexity on the held-out tail of the corpus."""
    gc: GCConfig = field(default_factory=GCConfig)
    """Python gc and device-cache cadence."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hang watchdog: a silence far longer than recent steps dumps every rank's stacks to <run_dir>/stacks
    and aborts (exit status watchdog.exit_code)."""

    def validate(self) -> None:
        """Value rules, each error naming the dotted field; runs before any model or device work."""
        from fntrain.config import require_float, require_int, require_str

        require_str("run_dir", self.run_dir, non_empty=True)
        require_int("seed", self.seed, min=0)
        require_int("log_every", self.log_every, min=0)
        self.runtime.validate("runtime")
        if self.runtime.seed not in (RuntimeConfig().seed, self.seed):
            raise ValueError(
                f"runtime.seed ({self.runtime.seed}) is set from seed ({self.seed}) by this recipe: use --seed"
            )
        self.parallel.validate("parallel")
        for name in ("context", "n_layer", "n_head", "d_model"):
            require_int(f"model.{name}", getattr(self.model, name), min=1)
        if self.model.d_model % self.model.n_head:
            raise ValueError(
                f"model.d_model ({self.model.d_model}) must be divisible by model.n_head ({self.model.n_head})"
            )
        require_float("model.dropout", self.model.dropout, min=0.0, max=1.0)
        require_float("data.val_fraction", self.data.val_fraction, min=0.0, max=0.5)
        require_int("data.num_workers", self.data.num_workers, min=0)
        require_int("data.prefetch_depth", self.data.prefetch_depth, min=1)
        require_int("train.global_batch_size", self.train.global_batch_size, min=1)
        require_int("train.micro_batch_size", self.train.micro_batch_size, min=1)
        require_float("train.max_grad_norm", self.train.max_grad_norm, min=0.0)
        self.optim.validate("optim")
        self.schedule.validate("schedule")
        self.memory.validate("memory")
        self.profiler.validate("profiler")
        self.checkpoint.validate("checkpoint")
        self.metrics.validate("metrics")
        self.throughput.validate("throughput")
        self.progress.validate("progress")
        self.evaluate.validate("evaluate")
        self.gc.validate("gc")
        self.watchdog.validate("watchdog")


# ----------------------------------------------------------------------------- model (nanoGPT-style)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        else:  # a boolean mask that already holds causality (packed documents: block-diagonal causal)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
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

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask)
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

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab]. Packed sequences (fntrain.data.packing) pass `position_ids` that restart
        at each document and a 4-D boolean `attention_mask` [batch, 1, seq, seq] (True: may attend) that
        keeps attention inside each document; a 2-D padding mask is ignored (attention stays causal)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
        attn_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
        x = self.drop(self.tok(input_ids) + self.pos(position_ids))
        for block in self.blocks:
            x = block(x) if attn_mask is None else block(x, attn_mask)
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


def _corpus_path(config: TinyGPTConfig) -> Path:
    path = Path(config.data.path).expanduser() if config.data.path else CORPUS
    if not path.is_file():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist")
    return path


def _split_point(corpus_bytes: int, config: TinyGPTConfig) -> int:
    return int(corpus_bytes * (1.0 - config.data.val_fraction))


def dataset_sizes(config: TinyGPTConfig) -> tuple[int, int]:
    """(train, validation) sample counts from the corpus file's size alone (no read): the lengths
    `build_datasets` gives."""
    size = _corpus_path(config).stat().st_size
    split = _split_point(size, config)
    return split // config.model.context, (size - split) // config.model.context


def build_datasets(config: TinyGPTConfig) -> tuple[ByteChunks, ByteChunks]:
    """(train, validation): the corpus as bytes, its tail `val_fraction` held out."""
    path = _corpus_path(config)
    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    split = _split_point(len(raw), config)
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


def build_hooks(built: Built, *, early: EarlyHooks | None = None, preemption: Preemption | None = None) -> list[Any]:
    """The standard hook list [S27] (memory, throughput, metrics, progress, evaluate, gc, profiler,
    checkpoint, then the hang watchdog). `early` holds the memory and profiler hooks `run` built before
    the model; `preemption` the checkpoint hook's signal handlers (`make_preemption`)."""
    from fntrain.config_file import config_to_dict

    config, runtime = built.config, built.runtime
    micro_batch = {
        "input_ids": torch.zeros(config.train.micro_batch_size, config.model.context, dtype=torch.long),
        "labels": torch.zeros(config.train.micro_batch_size, config.model.context, dtype=torch.long),
    }
    return standard_hooks(
        config,
        runtime,
        built.plan,
        built.components,
        run_dir=built.run_dir,
        early=early,
        val_dataset=built.val_dataset,
        eval_micro_batch_size=config.train.micro_batch_size,
        autocast_dtype=autocast_dtype(config.parallel),
        dp_group=data_parallel_group(runtime),
        # FLOPs of the unwrapped model, counted at TRAIN_BEGIN on a meta copy: no memory, no device work
        flops_per_token=lambda: measure_flops_per_token(
            lambda: TinyGPT(config.model), micro_batch, loss_fn=causal_lm_loss
        ),
        run_config=config_to_dict(config),
        preemption=preemption,
    )


def build(config: TinyGPTConfig, runtime: Runtime) -> Built:
    """Build model, loss, data, plan, optimizer and schedule, in that order [S1]."""
    if config.parallel.meta_init:  # meta device -> parallelize -> local shards, seeded as below
        from fntrain.runtime.materialize import build_model, seeded_init

        fill = seeded_init(config.seed, post_init=TinyGPT._init)
        model = build_model(lambda: TinyGPT(config.model), runtime, config.parallel, fill=fill)
    else:
        torch.manual_seed(config.seed)
        model = TinyGPT(config.model).to(runtime.device)
        model = parallelize(model, runtime, config.parallel)
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
        num_workers=config.data.num_workers,
        prefetch=config.data.prefetch,
        prefetch_depth=config.data.prefetch_depth,
        pin_memory=config.data.pin_memory and runtime.device.type != "cpu",
    )
    optimizer = build_optimizer(config.optim, model).optimizer
    schedule = build_lr_schedule(config.schedule, plan, optimizer).scheduler
    components = Components(
        model=model,
        loss_fn=causal_lm_loss,
        optimizers=(optimizer,),
        schedulers=(schedule,),
        grad_scaler=build_grad_scaler(config.parallel, runtime),
    )
    return Built(config, runtime, plan, components, data, val_set, Path(config.run_dir).expanduser())


def write_resolved_config(config: TinyGPTConfig, run_dir: Path) -> None:
    """The resolved config, effective seed included, as JSON in the run directory [S2]; it reads back
    with `--config <run_dir>/config.json`."""
    from fntrain.config_file import write_config

    write_config(config, run_dir)


def run(config: TinyGPTConfig, state: TrainState | None = None) -> TrainState:
    """Validate, build, restore (checkpoint.restore_from, unless `state` is given), train, export the
    weights; return the final `TrainState`. Logs go to <run_dir>/logs/rank_<r>.log too, and
    <run_dir>/run_metadata.json records the launch. A run stopped by a preemption signal raises
    `fntrain.preemption.Preempted` (a SystemExit with checkpoint.preempt_exit_code) after its clean
    teardown, without exporting."""
    config.validate()
    runtime_config = dataclasses.replace(config.runtime, seed=config.seed)
    preemption = make_preemption(config.checkpoint)
    with setup_runtime(runtime_config, config.parallel) as runtime, contextlib.ExitStack() as logs:
        early = early_hooks(config, runtime)  # before the model: bad settings fail first [S9]
        # Files only once the settings checked before any model work have passed [S9].
        logs.enter_context(rank_logs(config.run_dir, runtime.rank))
        write_run_metadata(config.run_dir, runtime)
        built = build(config, runtime)
        if runtime.is_main:
            write_resolved_config(dataclasses.replace(config, runtime=runtime_config), built.run_dir)
        components = built.components
        step_fn = parallel_train_step(
            components,
            runtime,
            config.parallel,
            max_grad_norm=config.train.max_grad_norm,
            loss_weighting=config.train.loss_weighting,
        )
        hooks = build_hooks(built, early=early, preemption=preemption)
        if state is None:
            state = restore_run(config, components, runtime, built.run_dir, hooks)
        record_start(built.run_dir, runtime, state)
        final = train(
            state,
            step_fn,
            hooks,
            data=data_fn(built.data),
            plan=built.plan,
            count_batch=count_batch,
        )
        if config.checkpoint.export and preemption.stopped_at is None:
            from fntrain.checkpoint import export_safetensors

            # A collective under FSDP2 (every rank gathers), written by rank 0.
            export_safetensors(components.model, built.run_dir / "model.safetensors", metadata=final.as_dict())
    preemption.raise_if_stopped(final)
    return final


def plan(config: TinyGPTConfig, world_size: int = 1) -> dict[str, Any]:
    """The resolved run plan for `world_size` ranks (what `fntrain plan tiny_gpt` prints): run length,
    batch shape, checkpoint steps, profiler and memory windows and the ranks that record. Builds no
    model, reads no corpus (its size is enough) and touches no device."""
    from fntrain.plan_report import describe_run_plan

    config.validate()
    train_len, val_len = dataset_sizes(config)
    parallel = getattr(config, "parallel", None)
    model_parallel = 1
    for name in ("tp_size", "pp_size", "cp_size"):
        model_parallel *= int(getattr(parallel, name, 1) or 1)
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by tp x pp x cp = {model_parallel}")
    hsdp_shape(world_size // model_parallel, getattr(parallel, "replicate", 1))  # HSDP replicas divide dp
    run_plan = make_run_plan(
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=config.train.micro_batch_size,
        dp_size=world_size // model_parallel,
        train_iters=config.train.train_iters,
        train_samples=config.train.train_samples,
        dataset_len=train_len,
        lr_schedule_iters=config.schedule.lr_schedule_iters,
    )
    memory = getattr(config, "memory", None)
    return describe_run_plan(
        run_plan,
        world_size=world_size,
        pp_size=int(getattr(parallel, "pp_size", 1) or 1),
        device_type=config.runtime.device,
        dataset_len=train_len,
        profiler=profiler_config(config),
        memory=memory_config(config) if memory is not None else None,
        checkpoint=dataclasses.replace(config.checkpoint, dir=str(checkpoint_root(config.checkpoint, config.run_dir))),
        extra={"val_samples": val_len, "run_dir": config.run_dir},
    )


Config = TinyGPTConfig  # the name the `fntrain` command looks for


def main(argv: list[str] | None = None) -> TrainState:
    """`python -m recipes.tiny_gpt [--config FILE] [overrides]`."""
    from fntrain.config_file import parse_config_cli
    from fntrain.logs import setup_console_logging

    setup_console_logging()  # [rank r] prefixes; other ranks: warnings and errors only
    config = parse_config_cli(TinyGPTConfig, argv, description=__doc__)
    return run(config)


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(main)
