"""The run's first phase: everything that can be known without training, before any file, model or
device work. Every failure is a `ConfigError` naming the field (the CLI prints it as one line naming
the flag, exit status 2), so a bad command leaves the run directory exactly as it found it.

    check_run(config, spec)        all of the below, in order; returns what phase 2 builds on
        check_values               every section's value rules, once, the objective's layouts and rules
                                   (`fntrain.step.objective`), and the batch shape over the ranks
        check_launcher             a strategy that needs a process group is launched by torchrun
        layout.check               the layout's rules: what the recipe's model supports, which sizes
        layout.check_device        combine, the devices it runs on (`fntrain.step.layouts`)
        check_sampling             samples are asked only of a recipe that can sample text
        check_device_settings      the device and the memory / profiler hooks' rank lists
        check_packages             optional packages the settings need are importable
        check_paths                run_dir, the checkpoint root and output_dir are writable directories
        read_inputs                the recipe's tokenizer and data, read and parsed
        run_plan                   the run length over the data (data too small for one step)
        decide_launch              fresh, resume, overwrite or complete: decided once (launch.py), the
                                   checkpoint's settings and data fingerprint compared with this run's
        check_windows              profiler and memory windows inside the run
        spec.check                 the recipe's own checks (model directory, LoRA targets)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fntrain.checkpoint.layout import checkpoint_root
from fntrain.config import ConfigError
from fntrain.data.files import existing_ancestor
from fntrain.data.fingerprint import data_fingerprint
from fntrain.data.stream import is_iterable_dataset
from fntrain.hooks.sample import check_sampling
from fntrain.hooks.sinks import check_metric_packages
from fntrain.hooks.standard import check_early_hooks
from fntrain.run.config import JobConfig, RecipeSpec
from fntrain.run.launch import Launch, decide_launch
from fntrain.runtime.device import resolve_device_type
from fntrain.runtime.groups import hsdp_shape
from fntrain.runtime.launch import LaunchEnv, read_launch_env
from fntrain.runtime.materialize import build_on_meta
from fntrain.runtime.runtime import Runtime
from fntrain.state import GenerationShape, RunPlan, make_run_plan
from fntrain.step.layouts import choose_layout
from fntrain.step.objective import check_objective, check_parallel

__all__ = [
    "Inputs", "Checked", "check_run", "check_values", "check_launcher",
    "check_device_settings", "check_paths", "read_inputs",
    "run_plan", "generation_shape", "dataset_len", "full_model_on_meta",
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
    """What phase 1 established: the launch environment, the data-parallel size, what this launch is
    (fresh, resume, overwrite, complete), the inputs and the run plan over them, and the data's
    fingerprint (what each checkpoint records)."""

    env: LaunchEnv
    dp_size: int
    launch: Launch
    inputs: Inputs
    plan: RunPlan
    fingerprint: dict[str, Any] | None = None


def check_run(config: JobConfig, spec: RecipeSpec) -> Checked:
    """Phase 1 (see the module docstring); every user error is a `ConfigError`."""
    try:
        env = read_launch_env()
        dp_size = check_values(config, env.world_size, spec.objective)
        check_launcher(config, env)
        layout = choose_layout(config.parallel)
        layout.check(config, spec, dp_size)
        check_sampling(config.sample, spec.sampler is not None)
        layout.check_device(config)
        check_device_settings(config, env)
        check_packages(config)
        check_paths(config)
        inputs = read_inputs(config, spec)
        fingerprint = data_fingerprint(config, inputs.train_set)
        plan = run_plan(config, dataset_len(inputs.train_set), dp_size, generation_shape(config, spec, dp_size))
        launch = decide_launch(config, env.restart_count, fingerprint=fingerprint, train_iters=plan.train_iters)
        check_windows(config, plan)
        if spec.check is not None:
            spec.check(config, inputs.assets)
    except ConfigError:
        raise
    except SETTING_ERRORS as error:
        raise ConfigError(str(error)) from error
    return Checked(env, dp_size, launch, inputs, plan, fingerprint)


def model_parallel_size(parallel: Any) -> int:
    """Ranks one model replica spans: tp x pp x cp."""
    return parallel.tp_size * parallel.pp_size * parallel.cp_size


def check_values(config: JobConfig, world_size: int, objective: Any = None) -> int:
    """Every section's value rules, the model-parallel sizes the recipe's objective (an `ObjectiveSpec`,
    or None) runs under, the batch shape over `world_size` ranks, and the objective's own rules; returns
    the data-parallel size."""
    config.validate()
    check_parallel(config, objective)
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
    check_objective(config, objective, dp_size)
    return dp_size


def check_launcher(config: JobConfig, env: LaunchEnv) -> None:
    """DDP, FSDP2 and model parallelism need a process group: torchrun (or a group made beforehand)."""
    needs_group = config.parallel.strategy != "none" or model_parallel_size(config.parallel) > 1
    if needs_group and not env.launched and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"parallel.strategy {config.parallel.strategy!r} (tp x pp x cp = "
            f"{model_parallel_size(config.parallel)}) needs a process group: launch with "
            "`torchrun --nproc_per_node N -m fntrain run ...`, or use parallel.strategy none"
        )


def full_model_on_meta(config: JobConfig, spec: RecipeSpec) -> Any:
    """The recipe's whole bare model on the meta device (no memory): what a pipeline splits."""
    return build_on_meta(lambda: spec.model_factory(config))


def check_device_settings(config: JobConfig, env: LaunchEnv) -> None:
    """The device itself and the memory and profiler hooks' backends and rank lists, checked for a
    stand-in runtime of this launch without building the hooks (the run builds them once, after the
    runtime is set up) [S9]."""
    try:
        device = torch.device(resolve_device_type(config.runtime.device))
        stand_in = Runtime(rank=env.rank, world_size=env.world_size, device=device,
                           tp_size=config.parallel.tp_size, pp_size=config.parallel.pp_size)  # fmt: skip
        check_early_hooks(config, stand_in)
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
        if not os.access(path, os.W_OK | os.X_OK) or not _can_create_in(path):
            raise ConfigError(f"{field} {str(path)!r} is not writable")
        return
    parent = existing_ancestor(path, field)  # a file there is a FileExistsError naming the field
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} {str(path)!r} cannot be created: {str(parent)!r} is not writable")
    if not _can_create_in(parent):
        raise ConfigError(
            f"{field} {str(path)!r} cannot be created: nothing can be created in {str(parent)!r} "
            "(a read-only or virtual filesystem)"
        )


def _can_create_in(directory: Path) -> bool:
    """Whether a directory can be made in `directory`: one is made and removed at once. Why a probe:
    os.access passes for root on a virtual filesystem (/proc, /sys), where mkdir still fails."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fntrain-probe-", dir=directory))
    except OSError:
        return False
    return True


def check_paths(config: JobConfig) -> None:
    """The run directory, the checkpoint root and (when the recipe has one) output_dir are writable
    directories."""
    _check_writable_dir("run_dir", config.run_dir)
    root = checkpoint_root(config.checkpoint, config.run_dir)
    _check_writable_dir("checkpoint.dir" if config.checkpoint.dir else "run_dir", root)
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


def generation_shape(config: JobConfig, spec: RecipeSpec, dp_size: int) -> GenerationShape | None:
    """How the recipe's objective reads prompts per generation batch (None: it reads batches)."""
    objective = spec.objective
    return objective.generation(config, dp_size) if objective is not None and objective.generation else None


def run_plan(config: JobConfig, train_len: int | None, dp_size: int, generation: GenerationShape | None = None) -> RunPlan:
    """The run length and batch shape over `train_len` samples (a generating objective's: over its
    generation batches of prompts, each serving `generation.steps` steps); data too small for one step is
    a setting, not a bug."""
    train = config.train
    try:
        return make_run_plan(
            global_batch_size=train.global_batch_size, micro_batch_size=train.micro_batch_size,
            dp_size=dp_size, train_iters=train.train_iters, train_samples=train.train_samples,
            dataset_len=train_len, lr_schedule_iters=config.schedule.lr_schedule_iters, generation=generation,
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

