"""The run skeleton, written once: the shared job config, `run_job` and `plan_job`.

A recipe is a `RecipeSpec`: its config class (a `JobConfig` with the recipe's own sections, such as
`model` and `data`) and the parts only it knows (build the model, the datasets, the collate function,
the loss, the forward, an export). Everything a run does around them is here, in the order it happens:

    run_job(config, spec)
        check_job      every value rule, before any file, model or device work
        setup_runtime  distributed init, device, mesh, seed (torn down on the way out, even on errors)
        early hooks    memory and profiler hooks, whose device checks must fail before the model
        logs           <run_dir>/logs/rank_<r>.log, run_metadata.json
        build_job      model -> assets -> datasets -> collate -> plan -> optimizer -> schedule
        config.json    the resolved config (effective seed included), readable with --config
        restore        checkpoint.restore_from into the components and hook states
        train          run_training(...) -> TrainResult (completed, stopped or preempted)
        export         the spec's export (model.safetensors by default) unless preempted

`plan_job(config, spec, world_size)` resolves the same plan without a model or a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from fntrain.config import ConfigError, require_bool, require_choice, require_float, require_int, require_str
from fntrain.hooks.checkpoint import CheckpointConfig, checkpoint_root
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.gc import GCConfig
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.metrics import MetricsConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.throughput import ThroughputConfig
from fntrain.hooks.watchdog import WatchdogConfig
from fntrain.loop import Hook, TrainResult
from fntrain.optim import OptimizerConfig, ScheduleConfig
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.setup import RuntimeConfig
from fntrain.state import RunPlan, TrainState, make_run_plan

__all__ = [
    "TrainConfig",
    "LoaderConfig",
    "JobConfig",
    "RecipeSpec",
    "Built",
    "check_job",
    "check_device_settings",
    "build_job",
    "run_job",
    "plan_job",
    "config_fields",
]

log = logging.getLogger("fntrain.run.job")


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TrainConfig:
    """Run length and batch shape."""

    train_iters: int | None = 400
    """Optimizer steps to run (exclusive with train_samples)."""
    train_samples: int | None = None
    """Samples to train on; train_iters = train_samples // global_batch_size."""
    global_batch_size: int = 32
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 16
    """Samples per forward/backward."""
    max_grad_norm: float = 1.0
    """Clip the gradient norm to this (0 disables clipping)."""
    loss_weighting: Literal["token", "mean"] = "token"
    """token: token-weighted global mean; mean: plain mean over micro-batches and ranks."""

    def validate(self, prefix: str = "train") -> None:
        if self.train_iters is not None:
            require_int(f"{prefix}.train_iters", self.train_iters, min=1)
        if self.train_samples is not None:
            require_int(f"{prefix}.train_samples", self.train_samples, min=1)
        if (self.train_iters is None) == (self.train_samples is None):
            raise ValueError(f"set exactly one of {prefix}.train_iters and {prefix}.train_samples")
        require_int(f"{prefix}.global_batch_size", self.global_batch_size, min=1)
        require_int(f"{prefix}.micro_batch_size", self.micro_batch_size, min=1)
        if self.train_samples is not None and self.train_samples < self.global_batch_size:
            raise ValueError(
                f"{prefix}.train_samples ({self.train_samples}) must be >= {prefix}.global_batch_size "
                f"({self.global_batch_size}): it would give no optimizer step"
            )
        require_float(f"{prefix}.max_grad_norm", self.max_grad_norm, min=0.0)
        require_choice(f"{prefix}.loss_weighting", self.loss_weighting, ("token", "mean"))


@dataclass(frozen=True)
class LoaderConfig:
    """How samples are read: order, worker processes, background prefetch, pinned memory."""

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

    def validate(self, prefix: str = "loader") -> None:
        for name in ("shuffle", "prefetch", "pin_memory"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_int(f"{prefix}.num_workers", self.num_workers, min=0)
        require_int(f"{prefix}.prefetch_depth", self.prefetch_depth, min=1)


@dataclass(frozen=True)
class JobConfig:
    """What every run has: where it writes, its seed, runtime, parallelism, length, optimizer, schedule,
    data loading and the standard hooks. A recipe's config subclasses it, adding its own sections
    (`model`, `data`, ...) and overriding defaults; every section with a `validate(prefix)` is checked."""

    run_dir: str = "runs/job"
    """Directory for the resolved config, metrics.jsonl, logs, checkpoints and artifacts."""
    overwrite: bool = False
    """Start over in a run_dir that already holds a run (the old run moves aside whole, nothing deleted)."""
    seed: int = 42
    """Seed for initialisation, dropout and data order (python, numpy and torch)."""
    log_every: int = 10
    """Log metrics every N steps (0 = never)."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Device, distributed backend, determinism."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data parallelism (none / ddp / fsdp2 under torchrun), mixed precision, activation checkpointing, compile."""
    train: TrainConfig = field(default_factory=TrainConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Allocator-history snapshots and peak-memory logs; a relative save_path is under run_dir."""
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    """Step time, tokens/s, TFLOP/s and MFU (FLOPs per token measured on a meta copy of the model)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where the metrics logged every log_every steps go: <run_dir>/metrics.jsonl, TensorBoard."""
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    """The progress bar on rank 0."""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """Validation loss and perplexity on the recipe's validation split."""
    gc: GCConfig = field(default_factory=GCConfig)
    """Python gc and device-cache cadence."""
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    """A window of steps traced into <output_path>/profile/rank_<rank>/ (output_path: run_dir, or under it)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints under <run_dir>/checkpoints (or checkpoint.dir): cadence, retention, async, restore, export."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """Hang watchdog: a silence far longer than recent steps dumps stacks to <run_dir>/stacks and aborts."""

    # Fields a resumed run may change freely: they do not change the numbers it computes (cadences,
    # reporting, where files go, how data is loaded, how the model is spread over devices). Any other
    # change needs checkpoint.allow_changes. A recipe's config may add its own (e.g. an output path).
    FREE_FIELDS: ClassVar[tuple[str, ...]] = (
        "run_dir", "overwrite", "log_every", "runtime", "loader.num_workers", "loader.prefetch",
        "loader.prefetch_depth", "loader.pin_memory", "parallel.strategy", "parallel.reshard_after_forward",
        "parallel.activation_checkpointing", "parallel.compile", "parallel.compile_backend",
        "parallel.ddp_bucket_cap_mb", "parallel.find_unused_parameters", "parallel.replicate",
        "parallel.meta_init", "parallel.tp_size", "parallel.pp_size", "parallel.pp_schedule",
        "parallel.loss_parallel", "memory", "throughput", "metrics", "progress", "evaluate", "gc", "profiler",
        "checkpoint", "watchdog",
    )  # fmt: skip

    def validate(self) -> None:
        """Value rules, each error naming the dotted field; no file, model or device work. A recipe's
        config may override this to add rules across its sections (calling this first)."""
        require_str("run_dir", self.run_dir, non_empty=True)
        require_int("seed", self.seed, min=0)
        require_int("log_every", self.log_every, min=0)
        require_bool("overwrite", self.overwrite)
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if dataclasses.is_dataclass(value) and hasattr(value, "validate"):
                value.validate(item.name)


def config_fields(config_cls: type) -> list[str]:
    """Every dotted field name of a (nested) config dataclass, for messages that name flags."""
    import typing

    names: list[str] = []
    hints = typing.get_type_hints(config_cls)
    for item in dataclasses.fields(config_cls):
        names.append(item.name)
        hint = hints.get(item.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            names.extend(f"{item.name}.{sub}" for sub in config_fields(hint))
    return names


# ----------------------------------------------------------------------------- the recipe's parts


def _causal_lm_loss(output: Any, micro_batch: Mapping[str, Any]) -> Any:
    from fntrain.step import causal_lm_loss

    return causal_lm_loss(output, micro_batch)


def _default_forward(model: Any, micro_batch: Mapping[str, Any]) -> Any:
    from fntrain.step import default_forward

    return default_forward(model, micro_batch)


@dataclass(frozen=True)
class RecipeSpec:
    """What a recipe knows and the job does not; every callable takes the recipe's config first.

    - `config`: the recipe's config class, a `JobConfig` subclass (its flags are the CLI).
    - `build_model(config, runtime)`: the model on `runtime.device`, initialised or loaded, already
      parallelized (`fntrain.runtime.materialize.build_seeded_model` does it for a model class).
    - `build_datasets(config, assets)`: (train, validation or None), map-style or iterable datasets.
    - `build_assets(config)`: what datasets and export need besides the config (a tokenizer), or None.
    - `collate(config, assets)`: the collate function of a list of samples (None: torch's default).
    - `loss(output, micro_batch)`: the mean loss over the micro-batch's valid tokens.
    - `forward(model, micro_batch)`: the model's output; used by the step, evaluation and FLOP counting.
    - `model_factory(config)`: the bare model, built on the meta device to count FLOPs per token with
      a real micro-batch (None: throughput reports no FLOPs).
    - `dataset_sizes(config)`: (train, validation) sample counts without reading the data, for plans.
    - `export(config, built, state)`: write the trained model after a run that was not preempted
      (besides `<run_dir>/model.safetensors`, written when checkpoint.export is set).
    - `eval_metrics(config, built)`: a function returning extra validation metrics (e.g. answer
      accuracy), called at every evaluation on every rank, beside the validation loss.
    - `hooks(built)`: extra hooks, run after the standard ones and before the checkpoint hook.
    - `describe(config)`: extra lines for the plan printout.
    - `tensor_parallel(model, tp_mesh, loss_parallel)`: the model family's tensor-parallel plan
      (`fntrain.runtime.tensor_parallel.tensor_parallel_plan`); None: --parallel.tp-size must be 1.
    - `pipeline`: where the model's pipeline stages are cut (`fntrain.runtime.pipeline.PipelineSplit`);
      None: --parallel.pp-size must be 1. `build_model` passes both to `parallelize`.
    """

    config: type
    build_model: Callable[[Any, Any], Any]
    build_datasets: Callable[[Any, Any], tuple[Any, Any]]
    build_assets: Callable[[Any], Any] | None = None
    collate: Callable[[Any, Any], Callable[[list[Any]], Any]] | None = None
    loss: Callable[[Any, Mapping[str, Any]], Any] = _causal_lm_loss
    forward: Callable[[Any, Mapping[str, Any]], Any] = _default_forward
    model_factory: Callable[[Any], Any] | None = None
    dataset_sizes: Callable[[Any], tuple[int, int]] | None = None
    export: Callable[[Any, Built, TrainState], Any] | None = None
    eval_metrics: Callable[[Any, Built], Callable[[], Mapping[str, float]]] | None = None
    hooks: Callable[[Built], Sequence[Hook]] | None = None
    describe: Callable[[Any], Mapping[str, Any]] | None = None
    tensor_parallel: Callable[[Any, Any, bool], None] | None = None
    pipeline: Any = None

    def __post_init__(self) -> None:
        if not (isinstance(self.config, type) and issubclass(self.config, JobConfig)):
            raise TypeError(f"RecipeSpec.config must be a JobConfig subclass, got {self.config!r}")


@dataclass(frozen=True)
class Built:
    """Everything `build_job` made, for hooks, exports and tests."""

    config: Any
    runtime: Any
    plan: RunPlan
    components: Any
    assets: Any
    data: Any
    val_dataset: Any
    collate_fn: Any
    run_dir: Path


# ----------------------------------------------------------------------------- checks and plans


def _model_parallel(parallel: ParallelConfig) -> int:
    return parallel.tp_size * parallel.pp_size * parallel.cp_size


def check_job(config: JobConfig, world_size: int | None = None) -> int:
    """Every value rule of `config` and the batch shape over `world_size` ranks (None: the launcher's
    WORLD_SIZE); returns the data-parallel size. Touches no file, model or device."""
    from fntrain.runtime.parallel import hsdp_shape
    from fntrain.runtime.setup import read_launch_env

    config.validate()
    if world_size is None:
        world_size = read_launch_env().world_size
    model_parallel = _model_parallel(config.parallel)
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by tp x pp x cp = {model_parallel}")
    dp_size = world_size // model_parallel
    hsdp_shape(dp_size, config.parallel.replicate)
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


def check_model_parallel(config: JobConfig, spec: RecipeSpec, dp_size: int) -> None:
    """Tensor and pipeline parallelism need the recipe's plan and split; a pipeline needs a step's
    micro-batches to fill it under 1F1B. A `ConfigError` naming the flag."""
    parallel = config.parallel
    if parallel.tp_size > 1 and spec.tensor_parallel is None:
        raise ConfigError(
            f"--parallel.tp-size {parallel.tp_size}: this recipe has no tensor-parallel plan for its model"
        )
    if parallel.pp_size > 1:
        if spec.pipeline is None or spec.model_factory is None:
            raise ConfigError(
                f"--parallel.pp-size {parallel.pp_size}: this recipe has no pipeline split for its model"
            )
        from fntrain.runtime.pipeline import stage_layers  # the split, counted on the meta device

        try:
            stage_layers(len(_full_model_of_stage(config, spec).get_submodule(spec.pipeline.layers)), parallel.pp_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        train = config.train
        micro_batches = train.global_batch_size // (train.micro_batch_size * dp_size)
        if parallel.pp_schedule == "1f1b" and micro_batches < parallel.pp_size:
            raise ConfigError(
                f"--parallel.pp-schedule 1f1b needs at least --parallel.pp-size ({parallel.pp_size}) micro-batches "
                f"per step, got {micro_batches} (--train.global-batch-size / (--train.micro-batch-size x {dp_size} "
                "data-parallel ranks)): lower --train.micro-batch-size or use --parallel.pp-schedule gpipe"
            )


def check_device_settings(config: JobConfig) -> None:
    """The settings that depend on the device and the ranks (the device itself, the memory and
    profiler hooks' backends and rank lists), checked by building those hooks for a stand-in runtime
    of this launch: building starts nothing [S9], so a bad setting fails before any file or model."""
    import torch

    from fntrain.hooks.standard import early_hooks
    from fntrain.runtime.device import resolve_device_type
    from fntrain.runtime.runtime import Runtime
    from fntrain.runtime.setup import read_launch_env

    launch = read_launch_env()
    device = torch.device(resolve_device_type(config.runtime.device))
    early_hooks(config, Runtime(rank=launch.rank, world_size=launch.world_size, device=device,
                                tp_size=config.parallel.tp_size, pp_size=config.parallel.pp_size))  # fmt: skip


def _run_plan(config: JobConfig, dataset_len: int | None, dp_size: int) -> RunPlan:
    try:
        return make_run_plan(
            global_batch_size=config.train.global_batch_size,
            micro_batch_size=config.train.micro_batch_size,
            dp_size=dp_size,
            train_iters=config.train.train_iters,
            train_samples=config.train.train_samples,
            dataset_len=dataset_len,
            lr_schedule_iters=config.schedule.lr_schedule_iters,
        )
    except ValueError as error:  # the data is too small for the batch shape: a setting, not a bug
        raise ConfigError(str(error)) from None


def _dataset_len(dataset: Any) -> int | None:
    from fntrain.data.stream import is_iterable_dataset

    return None if is_iterable_dataset(dataset) else len(dataset)


def plan_job(config: JobConfig, spec: RecipeSpec, world_size: int = 1) -> dict[str, Any]:
    """The resolved run plan for `world_size` ranks (what `fntrain plan` prints): run length, batch
    shape, checkpoint steps, profiler and memory windows and the ranks that record. Builds no model and
    touches no device; reads the data only when the spec has no `dataset_sizes`."""
    from fntrain.hooks.standard import memory_config, profiler_config
    from fntrain.plan.report import describe_run_plan

    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"--world-size must be a positive int, got {world_size!r}")
    dp_size = check_job(config, world_size)
    check_model_parallel(config, spec, dp_size)
    if spec.dataset_sizes is not None:
        train_len, val_len = spec.dataset_sizes(config)
    else:
        assets = spec.build_assets(config) if spec.build_assets else None
        train_set, val_set = spec.build_datasets(config, assets)
        train_len, val_len = _dataset_len(train_set), (len(val_set) if val_set is not None else 0)
    extra = {
        "val_samples": val_len,
        "run_dir": config.run_dir,
        **(spec.describe(config) if spec.describe else {}),
    }
    # Built on the meta device (no weights, no device), for the model families with a tensor-parallel
    # plan or a pipeline split: the layouts the estimate knows (a VLM's factory may write its model).
    if spec.model_factory is not None and (spec.tensor_parallel is not None or spec.pipeline is not None):
        from fntrain.plan.memory import plan_memory

        try:
            extra["memory_per_rank"] = plan_memory(config, spec.model_factory, world_size)
        except (ValueError, NotImplementedError, OSError) as error:  # a model it cannot count on meta
            extra["memory_per_rank"] = {"unavailable": str(error)}

    return describe_run_plan(
        _run_plan(config, train_len, dp_size),
        world_size=world_size,
        pp_size=config.parallel.pp_size,
        parallel=config.parallel,
        device_type=config.runtime.device,
        dataset_len=train_len,
        profiler=profiler_config(config),
        memory=memory_config(config),
        checkpoint=dataclasses.replace(
            config.checkpoint, dir=str(checkpoint_root(config.checkpoint, config.run_dir))
        ),
        extra=extra,
    )


# ----------------------------------------------------------------------------- building


def build_job(config: JobConfig, spec: RecipeSpec, runtime: Any) -> Built:
    """Model, assets, datasets, collate, plan, optimizer, schedule, in that order [S1]. A loss with a
    `bind_model(model)` method gets the parallelized model once [S4]."""
    from fntrain.components import Components
    from fntrain.data.pipeline import build_data
    from fntrain.optim import build_lr_schedule, build_optimizer
    from fntrain.runtime.parallel import build_grad_scaler

    model = spec.build_model(config, runtime)
    if callable(getattr(spec.loss, "bind_model", None)):
        spec.loss.bind_model(model)
    assets = spec.build_assets(config) if spec.build_assets else None
    train_set, val_set = spec.build_datasets(config, assets)
    collate_fn = spec.collate(config, assets) if spec.collate else None
    plan = _run_plan(config, _dataset_len(train_set), runtime.dp_size)
    loader = config.loader
    data = build_data(
        train_set,
        micro_batch_size=config.train.micro_batch_size,
        micro_batches=plan.micro_batches,
        collate_fn=collate_fn,
        shuffle=loader.shuffle,
        seed=config.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        num_workers=loader.num_workers,
        prefetch=loader.prefetch,
        prefetch_depth=loader.prefetch_depth,
        pin_memory=loader.pin_memory and runtime.device.type != "cpu",
    )
    optimizer = build_optimizer(config.optim, model, full_model=_full_model_of_stage(config, spec)).optimizer
    schedule = build_lr_schedule(config.schedule, plan, optimizer).scheduler
    components = Components(
        model=model,
        loss_fn=spec.loss,
        optimizers=(optimizer,),
        schedulers=(schedule,),
        grad_scaler=build_grad_scaler(config.parallel, runtime),
    )
    run_dir = Path(config.run_dir).expanduser()
    return Built(config, runtime, plan, components, assets, data, val_set, collate_fn, run_dir)


def _sample_micro_batch(built: Built) -> Any:
    """One micro-batch of the training data (host tensors), for counting FLOPs per token."""
    from torch.utils.data import default_collate

    dataset = built.data.dataset
    size = built.config.train.micro_batch_size
    if _dataset_len(dataset) is None:
        import itertools

        samples = list(itertools.islice(iter(dataset), size))
    else:
        samples = [dataset[i] for i in range(min(size, len(dataset)))]
    return (built.collate_fn or default_collate)(samples)


def _flops_per_token(built: Built, spec: RecipeSpec) -> Callable[[], float] | None:
    """FLOPs per token, counted when the throughput hook first needs them (at TRAIN_BEGIN) on a meta
    copy of the bare model with a real micro-batch: no memory, no device work."""
    if spec.model_factory is None:
        return None
    from fntrain.hooks.throughput import measure_flops_per_token

    def measure() -> float:
        return measure_flops_per_token(
            lambda: spec.model_factory(built.config),
            _sample_micro_batch(built),
            loss_fn=spec.loss,
            forward=spec.forward,
        )

    return measure


def job_hooks(built: Built, spec: RecipeSpec, early: Any = None, *, attempt: int = 0) -> list[Hook]:
    """The standard hook list (memory, throughput, metrics, progress, evaluate, gc, profiler, the
    spec's extra hooks, checkpoint, watchdog), wired to what `build_job` made."""
    from fntrain.hooks.standard import standard_hooks
    from fntrain.run.config_file import config_to_dict
    from fntrain.runtime.parallel import autocast_dtype, data_parallel_group

    config = built.config
    eval_forward, eval_loss = _eval_functions(built, spec)
    return standard_hooks(
        config,
        built.runtime,
        built.plan,
        built.components,
        run_dir=built.run_dir,
        early=early,
        val_dataset=built.val_dataset,
        eval_micro_batch_size=config.train.micro_batch_size,
        collate_fn=built.collate_fn,
        forward=eval_forward,
        eval_loss=eval_loss,
        autocast_dtype=autocast_dtype(config.parallel),
        dp_group=data_parallel_group(built.runtime),
        flops_per_token=_flops_per_token(built, spec),
        extra_eval=spec.eval_metrics(config, built) if spec.eval_metrics else None,
        run_config=config_to_dict(config),
        extra=list(spec.hooks(built)) if spec.hooks else (),
        attempt=attempt,
    )


def _eval_functions(built: Built, spec: RecipeSpec) -> tuple[Callable, Callable | None]:
    """(forward, loss) for evaluation: the spec's, run through the pipeline stages under pipeline
    parallelism, the loss under torch's loss_parallel() when the logits are split over the vocabulary."""
    from fntrain.runtime.parallel import loss_context, pipeline_layout

    runtime, parallel = built.runtime, built.config.parallel
    context = loss_context(runtime, parallel)
    if runtime.pp_size > 1:
        from fntrain.pipeline_step import make_pipeline_eval

        layout = pipeline_layout(runtime, parallel)
        return make_pipeline_eval(
            built.components.model, built.components.loss_fn, layout, runtime.device, context
        )
    if context is contextlib.nullcontext:
        return spec.forward, None
    loss_fn = built.components.loss_fn

    def eval_loss(output: Any, micro_batch: Mapping[str, Any]) -> Any:
        with context():
            return loss_fn(output, micro_batch)

    return spec.forward, eval_loss


def _full_model_of_stage(config: JobConfig, spec: RecipeSpec) -> Any:
    """Under pipeline parallelism the whole model on the meta device (a stage holds only part of it);
    else None."""
    if config.parallel.pp_size == 1:
        return None
    from fntrain.runtime.materialize import build_on_meta

    return build_on_meta(lambda: spec.model_factory(config))


def _pipeline_ties(config: JobConfig, spec: RecipeSpec) -> list[dict[int, str]]:
    """The weights of the recipe's model tied across pipeline stages (none without a pipeline)."""
    if config.parallel.pp_size == 1:
        return []
    from fntrain.runtime.pipeline import stage_ties

    return stage_ties(_full_model_of_stage(config, spec), spec.pipeline, config.parallel.pp_size)


# ----------------------------------------------------------------------------- running


def _first_launch() -> bool:
    """Whether this is the job's first launch (not a torchrun restart of it)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")


def _starting_over(config: JobConfig) -> JobConfig:
    """`config` as this launch runs it: starting over (`overwrite`, on a job's first launch) resumes
    nothing from the run directory's own checkpoints (latest / auto), which move aside with the old
    run; an explicit checkpoint path is still restored."""
    if config.overwrite and _first_launch() and config.checkpoint.restore_from in ("latest", "auto"):
        return dataclasses.replace(
            config, checkpoint=dataclasses.replace(config.checkpoint, restore_from="none")
        )
    return config


def _check_before_work(config: JobConfig, spec: RecipeSpec) -> Path | None:
    """Every check that needs no process group: values, device settings, the run directory, the
    settings of the run a resume continues; returns the checkpoint that check compared against."""
    from fntrain.run.directory import check_run_dir

    check_model_parallel(config, spec, check_job(config))
    try:
        check_device_settings(config)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    checkpoint = config.checkpoint
    check_run_dir(
        config.run_dir,
        checkpoint_root(checkpoint, config.run_dir),
        restore_from=checkpoint.restore_from,
        overwrite=config.overwrite,
    )
    newest = _newest_checkpoint(config)
    _resume_changes(config, newest)
    return newest


def _resume_changes(config: JobConfig, path: Path | None) -> dict[str, Any]:
    """The config changes a resume from the checkpoint `path` brings, allowed by
    `checkpoint.allow_changes` ({field: [old, new]}); any other change of a field that changes the
    numbers is a `ConfigError` listing them. A weights-only restore starts a new run: any change goes."""
    from fntrain.checkpoint import read_meta
    from fntrain.run.config_file import config_to_dict
    from fntrain.run.directory import config_changes

    checkpoint = config.checkpoint
    if path is None or checkpoint.weights_only:
        return {}
    try:
        saved = read_meta(path).get("config")
    except (OSError, ValueError):  # unreadable: the verified restore says what is wrong with it
        return {}
    if not saved:
        return {}
    allowed = {name.replace("-", "_") for name in checkpoint.allow_changes}
    changes = config_changes(saved, config_to_dict(config), free=config.FREE_FIELDS)
    refused = [(name, old, new) for name, old, new in changes if name not in allowed]
    if refused:
        listed = "; ".join(f"`{name}` {old!r} -> {new!r}" for name, old, new in refused)
        raise ConfigError(
            f"checkpoint.restore_from {str(path)!r} belongs to a run with other settings: {listed}; "
            "resume with the same settings, or name each field in checkpoint.allow_changes"
        )
    return {name: [old, new] for name, old, new in changes}


def _newest_checkpoint(config: JobConfig) -> Path | None:
    """The checkpoint `checkpoint.restore_from` names, read from the files alone (not verified, no
    process group): what the resume checks compare against before any work."""
    from fntrain.checkpoint import find_latest
    from fntrain.checkpoint.layout import MARKER
    from fntrain.checkpoint.restorer import NAMED_DAMAGED_HINT
    from fntrain.checkpoint.verify import CheckpointDamagedError, damage

    source = config.checkpoint.restore_from
    if source == "none":
        return None
    if source in ("latest", "auto"):
        return find_latest(checkpoint_root(config.checkpoint, config.run_dir))
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"checkpoint.restore_from {source!r} does not exist")
    if (path / MARKER).is_file():  # a missing or cut-short file shows in the sizes: no file is read
        problem = damage(path, contents=False)
        if problem is not None:
            raise CheckpointDamagedError(problem, NAMED_DAMAGED_HINT)
    return path


def _checkpoint_to_resume(config: JobConfig, runtime: Any, checked: Path | None) -> tuple[Path | None, dict]:
    """The verified checkpoint to restore (the same on every rank; None: a fresh start) and the config
    changes it brings; `checked` is the one already compared before any work (a damaged newest one is
    passed over for an older one, which is compared here)."""
    from fntrain.checkpoint.restorer import resolve_source

    checkpoint = config.checkpoint
    try:
        path = resolve_source(checkpoint.restore_from, checkpoint_root(checkpoint, config.run_dir))
    except FileNotFoundError as error:  # an explicit path that does not exist: a setting
        raise ConfigError(str(error)) from None
    changes = _resume_changes(config, path)
    for name, (old, new) in changes.items():
        log.warning("resuming with %s changed from %r to %r (checkpoint.allow_changes)", name, old, new)
    return path, changes


def _open_run_dir(config: JobConfig, runtime: Any, logs: contextlib.ExitStack) -> int:
    """Move an old run aside (--overwrite; rank 0, the others wait), open the per-rank logs, write
    run_metadata.json; return which launch of this run this is (tags the metrics records)."""
    from fntrain.run.directory import holds_run, move_aside
    from fntrain.run.logs import rank_logs
    from fntrain.run.metadata import read_attempt, write_run_metadata

    root = checkpoint_root(config.checkpoint, config.run_dir)
    # A torchrun restart of this job finds the run its first launch started: that one is kept.
    if config.overwrite and _first_launch() and runtime.is_main and holds_run(config.run_dir, root):
        log.warning("overwrite: the run in %s moved to %s", config.run_dir, move_aside(config.run_dir))
    if runtime.distributed:
        import torch.distributed as dist

        dist.barrier()  # no rank writes into the directory before the old run is out of the way
    logs.enter_context(rank_logs(config.run_dir, runtime.rank))
    write_run_metadata(config.run_dir, runtime)
    return read_attempt(config.run_dir) if runtime.is_main else 0


@dataclass(frozen=True)
class _Ready:
    """A run ready to train: what was built, its step function and hooks, the state it starts from."""

    built: Built
    step_fn: Any
    hooks: list[Hook]
    state: TrainState


def _prepare(config: JobConfig, spec: RecipeSpec, runtime: Any, early: Any, source: Any, state: Any,
             attempt: int) -> _Ready:  # fmt: skip
    """Build, write config.json, wire the step and hooks, restore `source` (unless `state` is given) and
    rewind the metrics log to the restored step."""
    from fntrain.hooks.metrics import rewind_metrics
    from fntrain.hooks.standard import restore_run
    from fntrain.run.config_file import write_config
    from fntrain.run.metadata import record_start
    from fntrain.run.report import describe_start
    from fntrain.runtime.parallel import parallel_train_step

    built = build_job(config, spec, runtime)
    if runtime.is_main:
        write_config(config, built.run_dir)
        for line in describe_start(built):  # parameters, world, plan: what is about to run
            log.info("%s", line)
    step_fn = parallel_train_step(
        built.components,
        runtime,
        config.parallel,
        max_grad_norm=config.train.max_grad_norm,
        loss_weighting=config.train.loss_weighting,
        forward=spec.forward,
        micro_batches=built.plan.micro_batches,
        ties=_pipeline_ties(config, spec),
    )
    hooks = job_hooks(built, spec, early, attempt=attempt)
    if state is None:
        restore_from = dataclasses.replace(config.checkpoint, restore_from=str(source) if source else "none")
        state = restore_run(dataclasses.replace(config, checkpoint=restore_from), built.components, runtime,
                            built.run_dir, hooks)  # fmt: skip
    if runtime.is_main and config.metrics.jsonl:
        moved = rewind_metrics(built.run_dir / config.metrics.jsonl_name, state.global_step)
        if moved:
            log.info("metrics: %d rows after step %d moved to the superseded log", moved, state.global_step)
    record_start(built.run_dir, runtime, state)
    return _Ready(built, step_fn, hooks, state)


def _export(config: JobConfig, spec: RecipeSpec, built: Built, state: TrainState) -> list[str]:
    """The spec's export, and <run_dir>/model.safetensors when checkpoint.export is set; where they went."""
    written = []
    if spec.export is not None:
        written.append(spec.export(config, built, state))
    if config.checkpoint.export:
        from fntrain.checkpoint import export_safetensors
        from fntrain.runtime.parallel import pipeline_group

        # A collective under FSDP2 (every rank gathers), written by rank 0.
        path = built.run_dir / "model.safetensors"
        export_safetensors(
            built.components.model,
            path,
            metadata=state.as_dict(),
            pipeline_group=pipeline_group(built.runtime),
        )
        written.append(path)
    return [str(path) for path in written if path is not None]


def _train(config: JobConfig, spec: RecipeSpec, ready: _Ready) -> tuple[TrainResult, list[str]]:
    """Train from the ready state (a finished run trains nothing) and export unless stopped by a notice."""
    from fntrain.data.pipeline import data_fn
    from fntrain.data.tokens import count_batch
    from fntrain.loop import run_training

    built, state = ready.built, ready.state
    if state.global_step >= built.plan.train_iters:
        log.warning("run already complete at step %d; nothing to do", state.global_step)
        # The exports are written again: a run killed while exporting finishes them here.
        return TrainResult(state, "completed", "already complete"), _export(config, spec, built, state)
    result = run_training(
        state, ready.step_fn, ready.hooks, data=data_fn(built.data), plan=built.plan, count_batch=count_batch
    )
    exported = (
        [] if result.outcome in ("preempted", "interrupted") else _export(config, spec, built, result.state)
    )
    return result, exported


def _summary(config: JobConfig, result: TrainResult, exported: list[str], seconds: float) -> str:
    """One line saying how the run ended: steps, tokens, wall time, losses, where the weights went."""
    from fntrain.hooks.metrics import summarize_metrics

    facts = summarize_metrics(Path(config.run_dir).expanduser() / config.metrics.jsonl_name)
    parts = [f"run {result.outcome} at step {result.state.global_step}"]
    if "consumed_tokens" in facts:
        parts.append(f"{facts['consumed_tokens']:,} tokens")
    parts.append(f"{seconds:.1f} s")
    if "loss" in facts:
        parts.append(f"final loss {facts['loss']:.4g}")
    if "best_val_loss" in facts:
        parts.append(f"best val_loss {facts['best_val_loss']:.4g} (step {facts['best_val_step']})")
    if exported:
        parts.append("weights in " + ", ".join(exported))
    elif result.outcome in ("preempted", "interrupted"):
        parts.append("resume with checkpoint.restore_from latest")
    return "; ".join(parts)


def run_job(config: JobConfig, spec: RecipeSpec, *, state: TrainState | None = None) -> TrainResult:
    """Check, set up, build, restore (checkpoint.restore_from, unless `state` is given), train, export;
    return how the run ended (`TrainResult`: final state, outcome, exit status). Logs go to
    <run_dir>/logs/rank_<r>.log too, and <run_dir>/run_metadata.json records the launch and its outcome.
    A preempted or interrupted run returns that outcome and its exit status after its clean teardown,
    unexported. Every bad setting (values, the device, the run directory, a resume into a run with other
    settings) is a `ValueError`/`ConfigError` before any file, model or device work."""
    import time

    from fntrain.hooks.metrics import metrics_writer
    from fntrain.hooks.standard import early_hooks
    from fntrain.run.metadata import record_outcome
    from fntrain.runtime.setup import setup_runtime

    config = _starting_over(config)
    try:
        checked = _check_before_work(config, spec)
    except (TypeError, ValueError, RuntimeError, OSError) as error:  # a setting: before any work
        raise ConfigError(str(error)) from error
    started = time.monotonic()
    with (
        setup_runtime(config.runtime, config.parallel, seed=config.seed) as runtime,
        contextlib.ExitStack() as logs,
    ):
        early = early_hooks(config, runtime)  # before the model: a bad device setting fails first [S9]
        source, changes = _checkpoint_to_resume(config, runtime, checked) if state is None else (None, {})
        attempt = _open_run_dir(config, runtime, logs)
        try:
            ready = _prepare(config, spec, runtime, early, source, state, attempt)
        except BaseException as error:
            record_outcome(config.run_dir, runtime, "failed before training", error=repr(error))
            raise
        result, exported = _train(config, spec, ready)
        seconds = time.monotonic() - started
        summary = _summary(config, result, exported, seconds)
        writer = metrics_writer(ready.hooks)
        if runtime.is_main:
            log.info("%s", summary)
        if writer is not None:  # the trackers get the end of the story too
            writer.summary(
                {"outcome": result.outcome, "wall_s": round(seconds, 1), "exported": ", ".join(exported)}
            )
        record_outcome(config.run_dir, runtime, result.outcome, end_state=result.state.as_dict(),
                       summary=summary, allowed_changes=changes, exported=exported)  # fmt: skip
    return result
