"""Optimizer and LR-schedule builders, configured by frozen configs [S8] [S25]."""

from __future__ import annotations

import math
import re
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

DECAY_GROUPINGS = ("fntrain", "hf")
WARMUP_STYLES = ("fntrain", "hf")

__all__ = [
    "DECAY_GROUPINGS",
    "WARMUP_STYLES",
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
    decay_grouping: Literal["fntrain", "hf"] = "fntrain"
    """Undecayed: fntrain = vectors and embedding tables; hf = biases and norms (transformers' Trainer)."""
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
        require_choice(f"{prefix}.decay_grouping", self.decay_grouping, DECAY_GROUPINGS)
        if self.decay_all and self.decay_grouping != "fntrain":
            raise ValueError(
                f"{prefix}.decay_all decays every parameter, so {prefix}.decay_grouping must stay 'fntrain', "
                f"got {self.decay_grouping!r}"
            )
        require_bool_or_none(f"{prefix}.fused", self.fused)


@dataclass(frozen=True)
class BuiltOptimizer:
    optimizer: torch.optim.Optimizer
    decayed_params: int
    undecayed_params: int


# transformers' Trainer.get_decay_parameter_names (transformers 5.x): parameters inside a torch LayerNorm,
# or whose lowercased dotted name matches one of these, skip weight decay. Written out here, not imported,
# so the grouping needs no transformers install; tests/step/test_hf_conventions.py holds it against Trainer's.
_HF_NO_DECAY_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def _hf_no_decay_names(model: torch.nn.Module) -> set[str]:
    """Names transformers' Trainer leaves undecayed: under a `torch.nn.LayerNorm` (its submodules' too), or
    named like a bias or a norm (every name a parameter has, tied or not)."""
    names = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        inside_layer_norm = isinstance(module, torch.nn.LayerNorm)
        # every parameter below the module (Trainer skips all of a LayerNorm's); full names, so a
        # parameter reached again from a deeper module is the same name
        for param_name, _ in module.named_parameters(remove_duplicate=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if inside_layer_norm or any(pattern.search(name.lower()) for pattern in _HF_NO_DECAY_PATTERNS):
                names.add(name)
    return names


def _no_decay_names(model: torch.nn.Module, grouping: str = "fntrain") -> set[str]:
    """Parameters excluded from weight decay, under every name they have (an output head tied to the
    token embedding is the embedding table). fntrain: vectors (norms, biases) and embedding tables;
    hf: transformers' Trainer grouping (`_hf_no_decay_names`)."""
    if grouping == "hf":
        names = _hf_no_decay_names(model)
    else:
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
    grouping_model = full_model if full_model is not None else model
    no_decay = set() if config.decay_all else _no_decay_names(grouping_model, config.decay_grouping)
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
    warmup_style: Literal["fntrain", "hf"] = "fntrain"
    """Warmup's first step at lr/W (fntrain) or at 0 (hf, as transformers' get_*_schedule_with_warmup)."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (linear and cosine)."""
    lr_schedule_iters: int | None = None
    """Schedule horizon in steps; None = train_iters."""

    def validate(self, prefix: str = "schedule") -> None:
        require_choice(f"{prefix}.kind", self.kind, ("constant", "linear", "cosine"))
        require_int(f"{prefix}.warmup_iters", self.warmup_iters, min=0)
        require_choice(f"{prefix}.warmup_style", self.warmup_style, WARMUP_STYLES)
        require_float(f"{prefix}.min_lr_ratio", self.min_lr_ratio, min=0.0, max=1.0)
        if self.lr_schedule_iters is not None:
            require_int(f"{prefix}.lr_schedule_iters", self.lr_schedule_iters, min=1)


@dataclass(frozen=True)
class BuiltSchedule:
    scheduler: torch.optim.lr_scheduler.LRScheduler
    horizon: int
    warmup_iters: int


def lr_factor(
    step: int,
    *,
    kind: str,
    warmup_iters: int,
    horizon: int,
    min_lr_ratio: float,
    warmup_style: str = "fntrain",
) -> float:
    """The multiplier of the peak lr after `step` scheduler steps, i.e. for optimizer step `step + 1` (a
    pure function). Warmup: (step + 1) / W (fntrain) or step / W (hf, transformers' schedules)."""
    if warmup_iters and step < warmup_iters:
        return (step if warmup_style == "hf" else step + 1) / warmup_iters
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
    kind, warmup, floor, style = config.kind, config.warmup_iters, config.min_lr_ratio, config.warmup_style

    def factor(step: int) -> float:
        return lr_factor(
            step, kind=kind, warmup_iters=warmup, horizon=horizon, min_lr_ratio=floor, warmup_style=style
        )

    return BuiltSchedule(torch.optim.lr_scheduler.LambdaLR(optimizer, factor), horizon, warmup)
