"""The run's first phase: everything that can be known without training, before any file, model or
device work. Every failure is a `ConfigError` naming the field (the CLI prints it as one line naming
the flag, exit status 2), so a bad command leaves the run directory exactly as it found it.

    check_run(config, spec)        all of the below, in order; returns what phase 2 builds on
        check_values               every section's value rules, once, and the batch shape over the ranks
        check_launcher             a strategy that needs a process group is launched by torchrun
        check_model_parallel       tensor / pipeline parallelism the recipe's model supports
        check_context_parallel     context parallelism the recipe's model and the other settings allow
        check_ring_device          ring attention runs on CUDA or NPU only
        check_device_settings      the device and the memory / profiler hooks' rank lists
        check_packages             optional packages the settings need are importable
        check_paths                run_dir, the checkpoint root and output_dir are writable directories
        decide_resume              the checkpoint to continue from, decided once (resume.py)
        read_inputs                the recipe's tokenizer and data, read and parsed
        with_data                  the data's fingerprint compared with the checkpoint's (resume.py)
        run_plan                   the run length over the data (data too small for one step)
        check_windows              profiler and memory windows inside the run
        spec.check                 the recipe's own checks (model directory, LoRA targets)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fntrain.config import ConfigError
from fntrain.data.files import existing_ancestor
from fntrain.data.fingerprint import data_fingerprint
from fntrain.data.stream import is_iterable_dataset
from fntrain.hooks.checkpoint import checkpoint_root
from fntrain.hooks.sinks import check_metric_packages
from fntrain.hooks.standard import early_hooks
from fntrain.run.config import JobConfig, RecipeSpec
from fntrain.run.directory import check_run_dir
from fntrain.run.resume import Resume, decide_resume, with_data
from fntrain.runtime.device import resolve_device_type
from fntrain.runtime.materialize import build_on_meta
from fntrain.runtime.parallel import hsdp_shape
from fntrain.runtime.pipeline import stage_layers
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.setup import LaunchEnv, read_launch_env
from fntrain.state import RunPlan, make_run_plan

__all__ = [
    "Inputs", "Checked", "check_run", "check_values", "check_launcher", "check_model_parallel",
    "check_context_parallel", "check_ring_device", "check_device_settings", "check_paths", "read_inputs",
    "run_plan", "dataset_len", "full_model_on_meta",
]  # fmt: skip

# Errors a check raises about the user's settings or files; anything else is a bug and propagates.
SETTING_ERRORS = (TypeError, ValueError, OSError, ImportError)


@dataclass(frozen=True)
class Inputs:
    """The recipe's tokenizer (or other assets), datasets and collate function, read in phase 1."""

    assets: Any
    train_set: Any
    val_set: Any
    collate_fn: Any


@dataclass(frozen=True)
class Checked:
    """What phase 1 established: the launch, the data-parallel size, the resume decision, the inputs and
    the run plan over them, and the data's fingerprint (what each checkpoint records)."""

    launch: LaunchEnv
    dp_size: int
    resume: Resume
    inputs: Inputs
    plan: RunPlan
    fingerprint: dict[str, Any] | None = None


def check_run(config: JobConfig, spec: RecipeSpec) -> Checked:
    """Phase 1 (see the module docstring); every user error is a `ConfigError`."""
    try:
        launch = read_launch_env()
        dp_size = check_values(config, launch.world_size)
        check_launcher(config, launch)
        check_model_parallel(config, spec, dp_size)
        check_context_parallel(config, spec)
        check_ring_device(config)
        check_device_settings(config, launch)
        check_packages(config)
        check_paths(config)
        resume = decide_resume(config)
        inputs = read_inputs(config, spec)
        fingerprint = data_fingerprint(config, inputs.train_set)
        resume = with_data(config, resume, fingerprint)
        plan = run_plan(config, dataset_len(inputs.train_set), dp_size)
        check_windows(config, plan)
        if spec.check is not None:
            spec.check(config, inputs.assets)
    except ConfigError:
        raise
    except SETTING_ERRORS as error:
        raise ConfigError(str(error)) from error
    return Checked(launch, dp_size, resume, inputs, plan, fingerprint)


def model_parallel_size(parallel: Any) -> int:
    """Ranks one model replica spans: tp x pp x cp."""
    return parallel.tp_size * parallel.pp_size * parallel.cp_size


def check_values(config: JobConfig, world_size: int) -> int:
    """Every section's value rules and the batch shape over `world_size` ranks; returns the
    data-parallel size."""
    config.validate()
    model_parallel = model_parallel_size(config.parallel)
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by tp x pp x cp = {model_parallel}")
    dp_size = world_size // model_parallel
    hsdp_shape(dp_size, config.parallel.replicate)
    if dp_size % config.parallel.ep_size:  # the ep ranks are borrowed from the data-parallel ones
        raise ConfigError(f"--parallel.ep-size {config.parallel.ep_size} must divide the data-parallel size ({dp_size})")
    if config.parallel.strategy == "none" and dp_size > 1:
        raise ConfigError(
            f"--parallel.strategy none cannot train {dp_size} data-parallel ranks (their gradients would never "
            "be combined): use --parallel.strategy ddp or fsdp2"
        )
    train = config.train
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:  # [S5]
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) must be divisible by "
            f"train.micro_batch_size ({train.micro_batch_size}) x data-parallel size ({dp_size}) = {per_step}"
        )
    return dp_size


def check_launcher(config: JobConfig, launch: LaunchEnv) -> None:
    """DDP, FSDP2 and model parallelism need a process group: torchrun (or a group made beforehand)."""
    needs_group = config.parallel.strategy != "none" or model_parallel_size(config.parallel) > 1
    if needs_group and not launch.launched and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"parallel.strategy {config.parallel.strategy!r} (tp x pp x cp = "
            f"{model_parallel_size(config.parallel)}) needs a process group: launch with "
            "`torchrun --nproc_per_node N -m fntrain run ...`, or use parallel.strategy none"
        )


def full_model_on_meta(config: JobConfig, spec: RecipeSpec) -> Any:
    """The recipe's whole bare model on the meta device (no memory): what a pipeline splits."""
    return build_on_meta(lambda: spec.model_factory(config))


def check_model_parallel(config: JobConfig, spec: RecipeSpec, dp_size: int) -> None:
    """Tensor and pipeline parallelism need the recipe's plan and split; a pipeline needs a step's
    micro-batches to fill it under 1F1B."""
    parallel = config.parallel
    if parallel.tp_size > 1 and spec.tensor_parallel is None:
        raise ConfigError(
            f"--parallel.tp-size {parallel.tp_size}: this recipe has no tensor-parallel plan for its model"
        )
    if parallel.pp_size == 1:
        return
    if spec.pipeline is None or spec.model_factory is None:
        raise ConfigError(f"--parallel.pp-size {parallel.pp_size}: this recipe has no pipeline split for its model")
    blocks = full_model_on_meta(config, spec).get_submodule(spec.pipeline.layers)
    stage_layers(len(blocks), parallel.pp_size)  # the split, counted on the meta device
    train = config.train
    micro_batches = train.global_batch_size // (train.micro_batch_size * dp_size)
    if parallel.pp_schedule == "1f1b" and micro_batches < parallel.pp_size:
        raise ConfigError(
            f"--parallel.pp-schedule 1f1b needs at least --parallel.pp-size ({parallel.pp_size}) micro-batches "
            f"per step, got {micro_batches} (--train.global-batch-size / (--train.micro-batch-size x {dp_size} "
            "data-parallel ranks)): lower --train.micro-batch-size or use --parallel.pp-schedule gpipe"
        )


def check_context_parallel(config: JobConfig, spec: RecipeSpec) -> None:
    """--parallel.cp-size > 1 needs a recipe whose attention can be split (`spec.attention_heads`), heads
    that divide by it, a data-parallel strategy (the cp ranks' gradients are summed) and none of the
    layouts it is not built for yet."""
    parallel = config.parallel
    if parallel.cp_size == 1:
        return
    cp = f"--parallel.cp-size {parallel.cp_size}"
    if spec.attention_heads is None:
        raise ConfigError(f"{cp}: this recipe's model has no context-parallel attention (use --parallel.cp-size 1)")
    heads = spec.attention_heads(config)
    if heads % parallel.cp_size:
        raise ConfigError(f"{cp} must divide the model's attention heads, got {heads}")
    if parallel.strategy == "none":
        raise ConfigError(
            f"{cp} needs --parallel.strategy ddp or fsdp2 (each cp rank's gradients cover only its slice "
            "of the sequence)"
        )
    others = (
        ("--parallel.tp-size", parallel.tp_size, 1), ("--parallel.pp-size", parallel.pp_size, 1),
        ("--parallel.replicate", parallel.replicate, 1),
        ("--parallel.activation-checkpointing", parallel.activation_checkpointing, False),
        ("--parallel.compile", parallel.compile, False),  # the attention's function mode is untested under dynamo
    )  # fmt: skip
    for flag, value, alone in others:
        if value != alone:
            raise ConfigError(f"{cp} cannot be combined with {flag} {value} yet")


def check_ring_device(config: JobConfig) -> None:
    """--parallel.cp-style ring runs on CUDA or NPU only (torch's ring attention has no CPU kernel)."""
    if config.parallel.cp_size == 1 or config.parallel.cp_style != "ring":
        return
    device = resolve_device_type(config.runtime.device)
    if device not in ("cuda", "npu"):
        raise ConfigError(
            f"--parallel.cp-style ring needs a CUDA or NPU device (torch's ring attention has no {device} "
            "kernel): use --parallel.cp-style ulysses"
        )


def check_device_settings(config: JobConfig, launch: LaunchEnv) -> None:
    """The device itself and the memory and profiler hooks' backends and rank lists, checked by
    building those hooks for a stand-in runtime of this launch: building starts nothing [S9]."""
    try:
        device = torch.device(resolve_device_type(config.runtime.device))
        stand_in = Runtime(rank=launch.rank, world_size=launch.world_size, device=device,
                           tp_size=config.parallel.tp_size, pp_size=config.parallel.pp_size)  # fmt: skip
        early_hooks(config, stand_in)
    except RuntimeError as error:  # a device this machine lacks, or without what a hook needs
        raise ConfigError(str(error)) from None


def check_packages(config: JobConfig) -> None:
    """The optional packages the metric sinks need are importable (found without importing them)."""
    check_metric_packages(config.metrics)


def _check_writable_dir(field: str, path: str | os.PathLike) -> None:
    """`path` is a directory this process can write into, or can be created as one: its nearest
    existing ancestor is a writable directory."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{field} {str(path)!r} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{field} {str(path)!r} is not writable")
        return
    parent = existing_ancestor(path, field)  # a file there is a FileExistsError naming the field
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} {str(path)!r} cannot be created: {str(parent)!r} is not writable")


def check_paths(config: JobConfig) -> None:
    """The run directory (one run per directory: a second one neither resumes nor starts over), the
    checkpoint root and (when the recipe has one) output_dir are writable directories."""
    _check_writable_dir("run_dir", config.run_dir)
    root = checkpoint_root(config.checkpoint, config.run_dir)
    _check_writable_dir("checkpoint.dir" if config.checkpoint.dir else "run_dir", root)
    check_run_dir(config.run_dir, root, restore_from=config.checkpoint.restore_from, overwrite=config.overwrite)
    if getattr(config, "output_dir", None):
        _check_writable_dir("output_dir", config.output_path())


def read_inputs(config: JobConfig, spec: RecipeSpec) -> Inputs:
    """The recipe's assets, datasets and collate function: reading them here makes a bad data file,
    tokenizer or image a setting error before any work, and phase 2 builds on what was read."""
    assets = spec.build_assets(config) if spec.build_assets else None
    train_set, val_set = spec.build_datasets(config, assets)
    collate_fn = spec.collate(config, assets) if spec.collate else None
    return Inputs(assets, train_set, val_set, collate_fn)


def dataset_len(dataset: Any) -> int | None:
    """A map-style dataset's length; None for an iterable (streamed) one."""
    return None if is_iterable_dataset(dataset) else len(dataset)


def run_plan(config: JobConfig, train_len: int | None, dp_size: int) -> RunPlan:
    """The run length and batch shape over `train_len` samples; data too small for one step is a
    setting, not a bug."""
    train = config.train
    try:
        return make_run_plan(
            global_batch_size=train.global_batch_size, micro_batch_size=train.micro_batch_size,
            dp_size=dp_size, train_iters=train.train_iters, train_samples=train.train_samples,
            dataset_len=train_len, lr_schedule_iters=config.schedule.lr_schedule_iters,
        )  # fmt: skip
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_windows(config: JobConfig, plan: RunPlan) -> None:
    """A profiler or memory window that starts after the run's last step would record nothing."""
    last = plan.train_iters
    windows = (
        ("profiler.start_step", config.profiler.enabled, config.profiler.start_step),
        ("memory.start_step", config.memory.enable or config.memory.mem_info, config.memory.start_step),
    )
    for field, enabled, start in windows:
        if enabled and start > last:
            raise ConfigError(f"{field} ({start}) is after the run's last step ({last}): it would record nothing")

