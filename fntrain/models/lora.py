"""LoRA for Hugging Face causal LMs through the `peft` library (the `lora` extra).

    config.validate("lora")                                     # before any model work
    model = load_causal_lm(model_config, runtime, parallel, wrap=lambda m: apply_lora(m, config, seed=s))
    ...train: only the adapter's parameters require gradients, so only they reach the optimizer...
    save_adapter_or_merged(model, config, output_dir, runtime, assets)

`apply_lora` wraps the model in a `peft.PeftModel` before it is parallelized: the base weights are
frozen (`requires_grad=False`), so `fntrain.step.optim.build_optimizer` builds state for the adapter only.
Checkpoints hold the whole model state dict (frozen base included, as DCP saves it) and the adapter's
optimizer state, so a resume is exact. The export writes the adapter in PEFT layout
(`adapter_config.json` + `adapter_model.safetensors`, loadable with `PeftModel.from_pretrained` or, with
peft installed, `AutoModelForCausalLM.from_pretrained`) or, with `merge_on_export`, the merged model in
save_pretrained layout. peft and transformers are imported inside functions only.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fntrain.config import ConfigError, require_bool, require_float, require_int
from fntrain.runtime import Runtime
from fntrain.runtime.materialize import build_on_meta

__all__ = [
    "LoraConfig",
    "apply_lora",
    "check_lora_parallel",
    "check_lora_targets",
    "trainable_parameters",
    "save_adapter_or_merged",
]

log = logging.getLogger("fntrain.models.lora")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, through peft): train small adapter matrices, keep the base weights frozen."""

    rank: int = 0
    """Rank of each adapter (0: LoRA off, every weight is fine-tuned)."""
    alpha: float = 16.0
    """Scaling numerator: adapter outputs are multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 keeps runs bitwise reproducible across resumes)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Names (or name suffixes) of the linear layers that get adapters, e.g. q_proj v_proj; all-linear: every linear layer but the output head."""
    merge_on_export: bool = False
    """Export the merged model (base + adapter, save_pretrained layout) instead of the adapter alone."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self, prefix: str = "lora") -> None:
        """Value rules naming `prefix.field`; with LoRA on, peft must be installed."""
        require_int(f"{prefix}.rank", self.rank, min=0)
        require_float(f"{prefix}.alpha", self.alpha, min=0.0, min_exclusive=True)
        require_float(f"{prefix}.dropout", self.dropout, min=0.0, max=1.0)
        if self.dropout >= 1.0:
            raise ValueError(f"{prefix}.dropout must be < 1, got {self.dropout!r}")
        names = self.target_modules
        if (
            not isinstance(names, (tuple, list))
            or not names
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(f"{prefix}.target_modules must be one or more module names, got {names!r}")
        if "all-linear" in names and len(names) > 1:
            raise ValueError(f"{prefix}.target_modules: all-linear stands alone, got {tuple(names)!r}")
        require_bool(f"{prefix}.merge_on_export", self.merge_on_export)
        if self.enabled and importlib.util.find_spec("peft") is None:
            raise ValueError(
                f"{prefix}.rank {self.rank} needs the peft library: pip install 'fntrain[lora]' "
                f"(or set {prefix}.rank 0 for full fine-tuning)"
            )


def check_lora_parallel(config: LoraConfig, meta_init: bool, prefix: str = "lora", *, tp_size: int = 1) -> None:
    """A ValueError when LoRA meets a model built on the meta device (its loader fills the base model's
    own parameter names; adapters are applied to a loaded model) or tensor parallelism (the model
    family's plan splits the base projections, not peft's adapter layers). Call it from a recipe's
    validate."""
    if config.enabled and meta_init:
        raise ValueError(f"{prefix}.rank > 0 cannot be combined with parallel.meta_init yet: turn one off")
    if config.enabled and tp_size > 1:
        raise ValueError(
            f"{prefix}.rank > 0 cannot be combined with parallel.tp_size={tp_size} yet: use fsdp2 data "
            "parallelism for LoRA"
        )


# The layers peft's LoRA can adapt (transformers' GPT-2 style Conv1D is matched by name: no import).
_ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
              torch.nn.MultiheadAttention)  # fmt: skip


def _adaptable(module: torch.nn.Module) -> bool:
    return isinstance(module, _ADAPTABLE) or type(module).__name__ == "Conv1D"


def check_lora_targets(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    targets: Sequence[str],
    field: str = "lora.target_modules",
) -> None:
    """A `ConfigError` naming `field` unless every name in `targets` names layers peft can adapt in
    `model`, matched as peft matches a list of names (a module whose dotted name is the target or ends
    with "." + target; "all-linear": any linear layer), every match a linear, embedding or convolution
    layer. `model` may be a factory of the bare model: it is built on the meta device (no weights, no
    memory), so the check runs before anything is loaded (the run's first phase). The error lists the
    names the model's adaptable layers end in."""
    if not isinstance(model, torch.nn.Module):
        model = build_on_meta(model)
    modules = [(name, module) for name, module in model.named_modules() if name]
    ends = sorted({name.rsplit(".", 1)[-1] for name, module in modules if _adaptable(module)})
    if tuple(targets) == ("all-linear",):
        if not any(isinstance(module, torch.nn.Linear) for _, module in modules):
            raise ConfigError(f"{field} all-linear: the model has no linear layer")
        return
    for target in targets:
        matched = [(name, module) for name, module in modules if name == target or name.endswith(f".{target}")]
        if not matched:
            raise ConfigError(
                f"{field} {target!r} matches no layer of the model; its linear, embedding and convolution "
                f"layers are named {', '.join(ends) or '(none)'}"
            )
        name, module = next(((n, m) for n, m in matched if not _adaptable(m)), (None, None))
        if module is not None:
            raise ConfigError(
                f"{field} {target!r} matches {name} ({type(module).__name__}), which LoRA cannot adapt: "
                f"name linear, embedding or convolution layers ({', '.join(ends) or 'none here'})"
            )


def _peft_config(config: LoraConfig) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    targets = config.target_modules
    return PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules="all-linear" if tuple(targets) == ("all-linear",) else list(targets),
        task_type="CAUSAL_LM",
    )


def apply_lora(model: torch.nn.Module, config: LoraConfig, *, seed: int | None = None) -> torch.nn.Module:
    """`model` wrapped in a `peft.PeftModel` with adapters on `config.target_modules` and every base
    weight frozen; `model` itself when LoRA is off. Call it before parallelizing. With `seed`, the
    adapters' initialisation draws from a generator seeded by it (identical on every rank, independent
    of what drew from the global RNG before) and the global RNG is left as it was."""
    if not config.enabled:
        return model
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        wrapped = get_peft_model(model, _peft_config(config))
    trainable, total = trainable_parameters(wrapped)
    log.info("LoRA rank %d: %s of %s parameters trainable (%.2f%%)", config.rank, f"{trainable:,}",
             f"{total:,}", 100.0 * trainable / max(total, 1))  # fmt: skip
    return wrapped


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (a DTensor counts its full size)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _full_state_dict(model: torch.nn.Module, runtime: Runtime) -> dict[str, torch.Tensor] | None:
    """The full state dict on CPU (a collective under a process group: FSDP2 shards are gathered);
    None without a process group (the model's own tensors are whole)."""
    if not runtime.distributed:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _merged_model(peft_model: Any, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of the base model with the adapter merged into its weights, built on the meta device
    from the trained model's config and filled with `state_dict` (the trained model is left as it is)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from fntrain.runtime.materialize import params_on_meta

    base_config = peft_model.get_base_model().config
    with params_on_meta():
        fresh = get_peft_model(
            AutoModelForCausalLM.from_config(base_config), peft_model.peft_config["default"]
        )
    # `assign` makes the fresh model hold these very tensors, which may be the trained model's own (one
    # process, or a group without sharding); merging adds the adapters into the adapted layers' base
    # weights in place, so those (only those: ".base_layer.") are copied first.
    fresh.load_state_dict(
        {key: value.clone() if ".base_layer." in key else value for key, value in state_dict.items()},
        strict=True,
        assign=True,
    )
    merged = fresh.merge_and_unload()
    if getattr(merged.config, "tie_word_embeddings", False):
        merged.tie_weights()
    return merged


def save_adapter_or_merged(
    model: torch.nn.Module, config: LoraConfig, output_dir: str | Path, runtime: Runtime, assets: Any = None
) -> Path:
    """Save the trained LoRA model to `output_dir`: the adapter in PEFT layout, or with
    `config.merge_on_export` the merged model in save_pretrained layout; the tokenizer of `assets` (a
    `fntrain.models.hf.ModelAssets`) beside it. With LoRA off it saves the whole model
    (`fntrain.models.hf.save_hf_model`). Under a process group every rank must call it (the full state
    dict is gathered); rank 0 writes. Returns `output_dir`."""
    from fntrain.models.hf import quiet_progress_bars, save_hf_model, unwrap

    if not config.enabled:
        return save_hf_model(model, assets, output_dir, runtime)
    output = Path(output_dir).expanduser()
    inner = unwrap(model)
    gathered = _full_state_dict(inner, runtime)
    if runtime.is_main:
        from fntrain.checkpoint.staged_out import replaced_dir

        # renamed in once complete: a failure leaves the previous one; no "Writing model shards" in logs
        with replaced_dir(output) as staging, quiet_progress_bars():
            if config.merge_on_export:
                state_dict = (
                    gathered
                    if gathered is not None
                    else {k: v.detach() for k, v in inner.state_dict().items()}
                )
                _merged_model(inner, state_dict).save_pretrained(str(staging))
            else:
                inner.save_pretrained(str(staging), state_dict=gathered)
            if assets is not None:
                assets.tokenizer.save_pretrained(str(staging))
        log.info("saved the %s to %s", "merged model" if config.merge_on_export else "LoRA adapter", output)
    return output
