"""Hugging Face causal LMs: local-only loading (plain or sharded on meta), tokenizer assets, saving.

    model_config.validate("model"); assets_config.validate("assets")    # before any model work
    model = load_causal_lm(model_config, runtime, parallel)            # loaded and parallelized
    assets = check_vocab(model_config, load_assets(model_config, assets_config))  # tokenizer + ids
    ...train...
    save_hf_model(model, assets, output_dir, runtime)                   # save_pretrained layout

Never downloads anything: a model path must be a local directory holding config.json and safetensors
weights (what `save_pretrained` writes), and the Hub's offline switches are set before transformers is
imported. transformers (the `hf` extra) is imported inside functions only. The configs and the checks
that read no more than config.json are `fntrain.models.hf_config`'s.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fntrain.checkpoint.hf_load import OFFLINE_SWITCHES, set_offline
from fntrain.config import ConfigError, first_line
from fntrain.models.hf_config import (
    DTYPES,
    AssetsConfig,
    HFModelConfig,
    model_vocab_size,
    read_chat_template,
    require_local_dir,
    require_model_config_dir,
    require_model_dir,
)
from fntrain.models.hf_tp import hf_tensor_parallel
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import ParallelConfig

__all__ = [
    "OFFLINE_SWITCHES",
    "set_offline",
    "ModelAssets",
    "load_assets",
    "load_tokenizer",
    "dtype_kwargs",
    "load_pretrained",
    "load_hf_config",
    "causal_lm_from_config",
    "load_causal_lm",
    "check_vocab",
    "quiet_progress_bars",
    "unwrap",
    "save_hf_model",
]

log = logging.getLogger("fntrain.models.hf")

# What save_pretrained writes for a tokenizer: one of these files is there when a directory holds one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


# ----------------------------------------------------------------------------- tokenizer assets


@dataclass(frozen=True)
class ModelAssets:
    """The tokenizer and the ids the data transform needs (`fntrain.data.sft.TokenizerAssets`)."""

    tokenizer: Any
    pad_id: int
    eos_id: int | None
    chat_template: str | None


def load_assets(model: HFModelConfig, assets: AssetsConfig) -> ModelAssets:
    """The tokenizer from the local tokenizer directory (default: the model's), with the chat template
    of `assets.chat_template` when given. pad_id falls back to EOS, then 0: padded positions are masked
    and their labels ignored, so any valid id will do."""
    set_offline()
    source = assets.tokenizer_path or model.path
    field_name = "assets.tokenizer_path" if assets.tokenizer_path else "model.path"
    tokenizer = load_tokenizer(field_name, source)
    if assets.chat_template is not None:
        tokenizer.chat_template = read_chat_template(assets.chat_template)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return ModelAssets(
        tokenizer=tokenizer,
        pad_id=int(pad_id) if pad_id is not None else 0,
        eos_id=int(eos_id) if eos_id is not None else None,
        chat_template=getattr(tokenizer, "chat_template", None),
    )


def load_tokenizer(field_name: str, source: str) -> Any:
    """The tokenizer saved in the local directory `source`; a directory without one, or one
    transformers cannot load, is a `ConfigError` naming `field_name` and the directory."""
    directory = require_local_dir(field_name, source)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        other = " (or set assets.tokenizer_path)" if field_name == "model.path" else ""
        raise ConfigError(
            f"{field_name} {source!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save one there "
            f"with tokenizer.save_pretrained{other}"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as error:  # transformers' ways of saying "cannot load"
        raise ConfigError(
            f"{field_name} {source!r}: its tokenizer cannot be loaded ({first_line(error)})"
        ) from None


def check_vocab(config: HFModelConfig, assets: ModelAssets) -> ModelAssets:
    """`assets`, or a `ConfigError` when the tokenizer has more tokens than the model's vocabulary (its
    config.json's vocab_size: read without loading the model)."""
    vocab = model_vocab_size(config)
    if isinstance(vocab, int) and len(assets.tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer has {len(assets.tokenizer)} tokens but the model's vocabulary only {vocab}: "
            "model.path and assets.tokenizer_path do not belong together"
        )
    return assets


# ----------------------------------------------------------------------------- model


def dtype_kwargs(dtype: torch.dtype | str | None) -> dict[str, Any]:
    """The keyword that gives transformers' `from_pretrained` / `from_config` a dtype: `dtype` from
    4.56 on (5.x knows only that name), `torch_dtype` before; {} for None."""
    if dtype is None:
        return {}
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


# _TRAINING_CONFIG: training runs the model without its KV cache (use_cache=False): a forward that fills a
# cache is wasted work, and activation checkpointing's recomputed forward would append to it a second time.


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") off inside the block when stderr is not a
    terminal: in a log file or a pipe a bar is a line per redraw, not a bar. Scoped: the setting the
    process had (the user's, or the progress hook's) is back after the block."""
    from transformers.utils import logging as hf_logging

    if _stderr_is_terminal() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def load_pretrained(config: HFModelConfig, device: torch.device | str) -> torch.nn.Module:
    """The causal LM from the local directory `config.path` (config + safetensors), on `device`,
    not parallelized."""
    set_offline()
    directory = require_model_dir("model.path", config.path)
    from transformers import AutoModelForCausalLM

    with quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            str(directory),
            local_files_only=True,
            use_safetensors=True,
            attn_implementation=config.attn_implementation,
            **dtype_kwargs("auto" if config.dtype == "auto" else DTYPES[config.dtype]),
        )
    model.config.use_cache = False  # see _TRAINING_CONFIG
    return model.to(device)


def load_hf_config(config: HFModelConfig, field_name: str = "model.path") -> Any:
    """The transformers config of the model directory `config.path` (its config.json); a directory
    transformers cannot read one from (an unknown model_type, a broken file) is a `ConfigError` naming
    `field_name` and the directory."""
    set_offline()
    directory = require_model_config_dir(field_name, config.path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:  # transformers' ways of saying "cannot read"
        raise ConfigError(
            f"{field_name} {config.path!r}: config.json is not a model config transformers reads ({first_line(error)})"
        ) from None


def causal_lm_from_config(config: HFModelConfig) -> torch.nn.Module:
    """The bare causal LM of `config.path`'s config.json, no weights loaded: build it under
    `fntrain.runtime.materialize.build_on_meta` to count FLOPs or check LoRA targets without memory.
    An architecture transformers has no causal LM for is a `ConfigError` naming model.path."""
    hf_config = load_hf_config(config)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation=config.attn_implementation)
    except ValueError as error:  # "Unrecognized configuration class ... for this kind of AutoModel"
        raise ConfigError(
            f"model.path {config.path!r} holds no causal LM transformers knows ({first_line(error)})"
        ) from None


def _load_on_meta(config: HFModelConfig, runtime: Runtime, parallel: ParallelConfig) -> torch.nn.Module:
    """The causal LM built on the meta device from config.json, parallelized, then filled from the
    safetensors through DCP's Hugging Face reader, each rank reading only its shards."""
    from transformers import AutoModelForCausalLM

    from fntrain.checkpoint.hf_load import hf_weights
    from fntrain.runtime.materialize import build_model

    directory = require_model_dir("model.path", config.path)
    hf_config = load_hf_config(config)
    hf_config.use_cache = False  # see _TRAINING_CONFIG
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = DTYPES.get(config.dtype) or saved  # auto: the checkpoint's, as from_pretrained does
    kwargs = dtype_kwargs(getattr(torch, dtype) if isinstance(dtype, str) else dtype)

    def factory() -> torch.nn.Module:
        return AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=config.attn_implementation, **kwargs
        )

    return build_model(
        factory, runtime, parallel, fill=hf_weights(directory), tensor_parallel=hf_tensor_parallel
    )


def load_causal_lm(
    config: HFModelConfig,
    runtime: Runtime,
    parallel: ParallelConfig,
    *,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """The causal LM of `config.path`, loaded and parallelized for training: returns what
    `fntrain.runtime.parallel.parallelize` returns (the DDP wrapper under ddp; `unwrap` gives the HF
    model). With `parallel.meta_init` it is built on meta, parallelized and filled shard by shard (no
    rank holds the full model under fsdp2); otherwise loaded whole on `runtime.device`, then
    parallelized. `wrap` (e.g. `fntrain.models.lora.apply_lora`) turns the loaded model into the one to
    train, between loading and parallelizing; it cannot be combined with `parallel.meta_init`. The
    model is returned in train mode."""
    set_offline()
    if parallel.meta_init:
        if wrap is not None:
            raise ValueError("load_causal_lm: wrap needs a loaded model; turn parallel.meta_init off")
        return _load_on_meta(config, runtime, parallel).train()
    from fntrain.runtime.parallel import parallelize

    model = load_pretrained(config, runtime.device)
    model = wrap(model) if wrap is not None else model
    # from_pretrained returns the model in eval mode; it trains in train mode (its dropout on), as
    # transformers' Trainer runs it.
    return parallelize(model, runtime, parallel, tensor_parallel=hf_tensor_parallel).train()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: no wrapper)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


# ----------------------------------------------------------------------------- saving


def save_hf_model(
    model: torch.nn.Module, assets: ModelAssets, output_dir: str | Path, runtime: Runtime
) -> Path:
    """Save the model (safetensors + config + generation config) and the tokenizer in save_pretrained
    layout to `output_dir`; returns it. Under a process group every rank must call it: the full state
    dict is gathered (FSDP2 shards included) to CPU, and rank 0 writes. Atomic: written as
    `.<name>.tmp-<pid>` beside `output_dir` and renamed over it once complete (other files a user put
    in an old `output_dir` are kept, its old weights are not: `fntrain.checkpoint.staged_out`)."""
    output = Path(output_dir).expanduser()
    inner = unwrap(model)
    state_dict = None
    if runtime.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(
            inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    if runtime.is_main:
        from fntrain.checkpoint.staged_out import replaced_dir

        inner.config.use_cache = True  # the saved model generates with its KV cache, as it was loaded
        try:
            # Written beside output_dir, renamed in once complete: a failure (a full disk) leaves the
            # previous export or none, never config files without weights.
            with replaced_dir(output) as staging, quiet_progress_bars():  # no "Writing model shards" in logs
                inner.save_pretrained(str(staging), state_dict=state_dict)
                assets.tokenizer.save_pretrained(str(staging))
        finally:
            inner.config.use_cache = False
        log.info("saved the model and tokenizer to %s", output)
    return output
