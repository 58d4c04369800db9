"""Optimizer and LR-schedule builders, configured by frozen configs [S8] [S25]."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from fntrain.config import (
    require_bool,
    require_bool_or_none,
    require_choice,
    require_float,
    require_float_tuple,
    require_int,
)
from fntrain.state import RunPlan

__all__ = [
    "OptimizerConfig",
    "BuiltOptimizer",
    "build_optimizer",
    "ScheduleConfig",
    "BuiltSchedule",
    "build_lr_schedule",
    "lr_factor",
]


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer settings."""

    name: Literal["adamw", "sgd"] = "adamw"
    """adamw or sgd."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only unless decay_all is set."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    momentum: float = 0.0
    """SGD momentum."""
    decay_all: bool = False
    """Apply weight decay to norms, biases and embeddings too."""
    fused: bool | None = None
    """Use the fused kernel (None: fused on cuda/npu where supported, foreach elsewhere)."""

    def validate(self, prefix: str = "optim") -> None:
        require_choice(f"{prefix}.name", self.name, ("adamw", "sgd"))
        require_float(f"{prefix}.lr", self.lr, min=0.0, min_exclusive=True)
        require_float(f"{prefix}.weight_decay", self.weight_decay, min=0.0)
        require_float(f"{prefix}.eps", self.eps, min=0.0, min_exclusive=True)
        require_float(f"{prefix}.momentum", self.momentum, min=0.0)
        require_float_tuple(f"{prefix}.betas", self.betas, length=2)
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"{prefix}.betas must be two numbers in [0, 1), got {self.betas!r}")
        require_bool(f"{prefix}.decay_all", self.decay_all)
        require_bool_or_none(f"{prefix}.fused", self.fused)


@dataclass(frozen=True)
class BuiltOptimizer:
    optimizer: torch.optim.Optimizer
    decayed_params: int
    undecayed_params: int


def _no_decay_names(model: torch.nn.Module) -> set[str]:
    """Parameters excluded from weight decay: vectors (norms, biases) and embedding tables, under every
    name they have (an output head tied to the token embedding is the embedding table)."""
    names = {name for name, p in model.named_parameters() if p.ndim < 2}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            for param_name, _ in module.named_parameters(recurse=False):
                names.add(f"{module_name}.{param_name}" if module_name else param_name)
    from fntrain.runtime.pipeline import tied_names

    return names | {alias for group in tied_names(model) if names.intersection(group) for alias in group}


def build_optimizer(
    config: OptimizerConfig, model: torch.nn.Module, *, full_model: torch.nn.Module | None = None
) -> BuiltOptimizer:
    """AdamW or SGD over `model`'s trainable parameters with weight-decay parameter groups. When `model`
    is one pipeline stage, `full_model` (the whole model, e.g. on the meta device) decides which names
    decay, so a stage decays exactly what a one-rank run does."""
    config.validate()
    no_decay = set() if config.decay_all else _no_decay_names(full_model if full_model is not None else model)
    decay, other = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (other if name in no_decay else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("the model has no trainable parameters")
    device_type = groups[0]["params"][0].device.type
    fused = config.fused if config.fused is not None else device_type in ("cuda", "npu")
    kernel = {"fused": True} if fused else {"foreach": True}
    if config.name == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **kernel)
    else:
        optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, **kernel)
    return BuiltOptimizer(optimizer, sum(p.numel() for p in decay), sum(p.numel() for p in other))


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr_ratio."""

    kind: Literal["constant", "linear", "cosine"] = "cosine"
    """Decay shape after warmup."""
    warmup_iters: int = 0
    """Optimizer steps of linear warmup from 0 to the peak lr."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (linear and cosine)."""
    lr_schedule_iters: int | None = None
    """Schedule horizon in steps; None = train_iters."""

    def validate(self, prefix: str = "schedule") -> None:
        require_choice(f"{prefix}.kind", self.kind, ("constant", "linear", "cosine"))
        require_int(f"{prefix}.warmup_iters", self.warmup_iters, min=0)
        require_float(f"{prefix}.min_lr_ratio", self.min_lr_ratio, min=0.0, max=1.0)
        if self.lr_schedule_iters is not None:
            require_int(f"{prefix}.lr_schedule_iters", self.lr_schedule_iters, min=1)


@dataclass(frozen=True)
class BuiltSchedule:
    scheduler: torch.optim.lr_scheduler.LRScheduler
    horizon: int
    warmup_iters: int


def lr_factor(step: int, *, kind: str, warmup_iters: int, horizon: int, min_lr_ratio: float) -> float:
    """The multiplier of the peak lr after `step` scheduler steps (a pure function)."""
    if warmup_iters and step < warmup_iters:
        return (step + 1) / warmup_iters
    if kind == "constant":
        return 1.0
    decay_steps = max(1, horizon - warmup_iters)
    progress = min(1.0, (step - warmup_iters) / decay_steps)
    if kind == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_schedule(
    config: ScheduleConfig, plan: RunPlan, optimizer: torch.optim.Optimizer
) -> BuiltSchedule:
    """A LambdaLR over `optimizer` with horizon `config.lr_schedule_iters` or the plan's [S8]."""
    config.validate()
    horizon = config.lr_schedule_iters if config.lr_schedule_iters is not None else plan.lr_schedule_iters
    if horizon <= 0:
        raise ValueError(f"schedule.lr_schedule_iters must be > 0, got {horizon}")
    kind, warmup, floor = config.kind, config.warmup_iters, config.min_lr_ratio

    def factor(step: int) -> float:
        return lr_factor(step, kind=kind, warmup_iters=warmup, horizon=horizon, min_lr_ratio=floor)

    return BuiltSchedule(torch.optim.lr_scheduler.LambdaLR(optimizer, factor), horizon, warmup)
