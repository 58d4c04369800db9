"""The shared job config and the recipe's spec: what every run has, and what only a recipe knows.

    TrainConfig                   run length and batch shape (LoaderConfig: fntrain.data.settings)
    JobConfig                     every section a run has (a recipe's config subclasses it)
    ExportingJobConfig            a JobConfig whose recipe writes its model to `output_dir` itself
    RecipeSpec                    the recipe's parts (model, datasets, collate, loss, forward, export, ...)
    Built                         what the build made, for hooks, exports and tests

Each section's `validate(prefix)` holds its value rules, checked once, in the run's first phase.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from fntrain.config import require_bool, require_choice, require_float, require_int, require_str
from fntrain.data.settings import LoaderConfig
from fntrain.hooks.checkpoint import SaveConfig
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.gc import GCConfig
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.metrics import MetricsConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.sample import SampleConfig
from fntrain.hooks.standard import under_run_dir
from fntrain.hooks.throughput import ThroughputConfig
from fntrain.loop import Hook
from fntrain.runtime.parallel import ParallelConfig
from fntrain.runtime.setup import RuntimeConfig
from fntrain.runtime.watchdog import WatchdogConfig
from fntrain.state import RunPlan, TrainState
from fntrain.step import causal_lm_loss, default_forward
from fntrain.step.objective import ObjectiveSpec
from fntrain.step.optim import OptimizerConfig, ScheduleConfig

__all__ = [
    "TrainConfig", "CheckpointConfig", "JobConfig", "ExportingJobConfig", "require_validation", "config_fields",
    "HFConversion", "RecipeSpec", "Built",
]  # fmt: skip

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
        # 10**12 steps or samples is far past any real run: a larger number is a typo, not a plan
        if self.train_iters is not None:
            require_int(f"{prefix}.train_iters", self.train_iters, min=1, max=10**12)
        if self.train_samples is not None:
            require_int(f"{prefix}.train_samples", self.train_samples, min=1, max=10**12)
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
class CheckpointConfig(SaveConfig):
    """When to save and restore checkpoints: the hook's saving fields (`SaveConfig`) and the run's resume
    and export policy."""

    # the fields naming files the run reads: recorded by absolute path (fntrain.run.resolved)
    PATH_FIELDS: ClassVar[tuple[str, ...]] = ("dir",)

    restore_from: str = "auto"
    """auto: rerunning a command in its run_dir resumes its newest checkpoint (or says the run is complete), a new run_dir starts fresh; latest: the same, warning when there is none; none: never resume; or a checkpoint path."""
    allow_changes: tuple[str, ...] = ()
    """Fields a resume may change although they change the numbers (e.g. train.train_iters); logged."""
    weights_only: bool = False
    """Restore the model weights only: fresh optimizer, schedule, RNG, and step 0."""
    export: bool = True
    """Write the final weights to <run_dir>/model.safetensors at the end of the run."""

    def validate(self, prefix: str = "checkpoint") -> None:
        super().validate(prefix)
        for name in ("weights_only", "export"):
            require_bool(f"{prefix}.{name}", getattr(self, name))
        require_str(f"{prefix}.restore_from", self.restore_from, non_empty=True)
        if not isinstance(self.allow_changes, (tuple, list)) or not all(
            isinstance(name, str) and name for name in self.allow_changes
        ):
            raise TypeError(f"{prefix}.allow_changes must be a list of config field names, got {self.allow_changes!r}")


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
    """Log metrics every N steps (0 = never); loss and grad_norm are the means since the last log."""
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
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Text the model writes from sample.prompts every sample.every steps and at the end: the log, <run_dir>/samples.jsonl, TensorBoard / W&B / MLflow."""
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
        "parallel.loss_parallel", "parallel.cp_size", "parallel.cp_style", "memory", "throughput", "metrics", "progress", "evaluate", "sample", "gc", "profiler",
        "checkpoint", "watchdog",
    )  # fmt: skip

    def validate(self) -> None:
        """Value rules, each error naming the dotted field; no file, model or device work. A recipe's
        config may override this to add rules across its sections (calling this first)."""
        require_str("run_dir", self.run_dir, non_empty=True)
        require_int("seed", self.seed, min=0, max=2**32 - 1)  # numpy's seeds are 32-bit
        require_int("log_every", self.log_every, min=0)
        require_bool("overwrite", self.overwrite)
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if dataclasses.is_dataclass(value) and hasattr(value, "validate"):
                value.validate(item.name)


@dataclass(frozen=True)
class ExportingJobConfig(JobConfig):
    """A job whose recipe writes the trained model itself (a Hugging Face `save_pretrained` directory)
    to `output_dir`: no `model.safetensors` besides it by default, and `output_dir` free to change on a
    resume."""

    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(export=False, save_every_minutes=30.0))
    """Resumable checkpoints under <run_dir>/checkpoints every 30 minutes and at the end (rerunning the command resumes); the fine-tuned model itself always goes to output_dir in save_pretrained layout."""
    output_dir: str | None = None
    """Where the fine-tuned model is saved (None: <run_dir>/hf_model)."""

    FREE_FIELDS: ClassVar[tuple[str, ...]] = (*JobConfig.FREE_FIELDS, "output_dir")

    def validate(self) -> None:
        super().validate()
        require_str("output_dir", self.output_dir, optional=True, non_empty=True)

    def output_path(self) -> Path:
        """Where the trained model goes: `output_dir` (relative: under run_dir), else <run_dir>/hf_model."""
        return Path(under_run_dir(self.run_dir, self.output_dir, "hf_model"))


def require_validation(config: JobConfig, has_validation: bool, how: str) -> None:
    """Evaluation needs a validation split: a `ValueError` saying `how` to get one when evaluation is
    on and `has_validation` is false."""
    if config.evaluate.enabled and not has_validation:
        raise ValueError(f"evaluate needs validation data: {how}")


def config_fields(config_cls: type) -> list[str]:
    """Every dotted field name of a (nested) config dataclass, for messages that name flags."""
    names: list[str] = []
    hints = typing.get_type_hints(config_cls)
    for item in dataclasses.fields(config_cls):
        names.append(item.name)
        hint = hints.get(item.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            names.extend(f"{item.name}.{sub}" for sub in config_fields(hint))
    return names


# ----------------------------------------------------------------------------- the recipe's parts


@dataclass(frozen=True)
class HFConversion:
    """A recipe's own model as a transformers one. `model(config, state_dict)`: (config.json's dict,
    tensors under the transformers names) of the model's full state dict. `tokenizer(config)`: what
    writes that model's tokenizer files into a directory (tiny_gpt: its bytes, or its token shards'
    tokenizer), so an export loads in transformers and lm-eval with its text; None (or a `tokenizer`
    returning None) when the run's files name none that can be read."""

    model: Callable[[Any, Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any]]]
    tokenizer: Callable[[Any], Callable[[Path], None] | None] | None = None


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
    - `hf_conversion`: the recipe's own model as a transformers one (`HFConversion`: its weights and
      config, and its tokenizer). `fntrain export --format hf` applies it to a checkpoint of this recipe
      (None: the model's own names and an fntrain config.json); a recipe's `export` uses it too, so
      both write the same model.
    - `eval_metrics(config, built)`: a function returning extra validation metrics (e.g. answer
      accuracy), called at every evaluation on every rank, beside the validation loss.
    - `sampler(config, built)`: text sampling for the samples during training (`--sample.*`): a
      function (prompt, `fntrain.sampling.SampleSettings`, torch.Generator) -> the text the
      built model writes after the prompt, drawing only from that generator; None: the recipe cannot
      sample (asking for samples is then a `ConfigError` naming the flag).
    - `hooks(built)`: extra hooks, run after the standard ones and before the checkpoint hook.
    - `step_end(config, built)`: a function the step calls after every optimizer update, outside
      autograd, returning more step metrics as device tensors (MoE: router bias update, expert load),
      or None; not supported under pipeline parallelism.
    - `describe(config)`: extra lines for the plan printout.
    - `check(config, assets)`: the recipe's own checks before any file, model or device work, after its
      data was read (a model directory's contents, LoRA targets on a meta copy of the model); raises
      `ConfigError` naming the field.
    - `tensor_parallel(model, tp_mesh, loss_parallel)`: the model family's tensor-parallel plan
      (`fntrain.runtime.tensor_parallel.tensor_parallel_plan`); None: --parallel.tp-size must be 1.
    - `pipeline`: where the model's pipeline stages are cut (`fntrain.runtime.pipeline.PipelineSplit`);
      None: --parallel.pp-size must be 1. `build_model` passes both to `parallelize`.
    - `attention_heads(config)`: the model's attention heads per layer (key/value heads too must divide
      by cp), for context parallelism: its attention calls `F.scaled_dot_product_attention` with
      (batch, heads, seq, dim) tensors and a whole-sequence mask, which `fntrain.step.context_parallel`
      splits; None: --parallel.cp-size must be 1.
    - `objective`: a step that minimises something else than `loss` (`fntrain.step.objective.ObjectiveSpec`:
      DPO, distillation, GRPO): one entry with its rules, the layouts it runs on, how it reads its data,
      and how its forward, loss, rollout phase and hooks are built over the built model; None: `forward`
      and `loss`.
    """

    config: type
    build_model: Callable[[Any, Any], Any]
    build_datasets: Callable[[Any, Any], tuple[Any, Any]]
    build_assets: Callable[[Any], Any] | None = None
    collate: Callable[[Any, Any], Callable[[list[Any]], Any]] | None = None
    loss: Callable[[Any, Mapping[str, Any]], Any] = causal_lm_loss
    forward: Callable[[Any, Mapping[str, Any]], Any] = default_forward
    model_factory: Callable[[Any], Any] | None = None
    dataset_sizes: Callable[[Any], tuple[int, int]] | None = None
    export: Callable[[Any, Built, TrainState], Any] | None = None
    hf_conversion: HFConversion | None = None
    eval_metrics: Callable[[Any, Built], Callable[[], Mapping[str, float]]] | None = None
    hooks: Callable[[Built], Sequence[Hook]] | None = None
    step_end: Callable[[Any, Built], Callable[[], Mapping[str, Any]] | None] | None = None
    describe: Callable[[Any], Mapping[str, Any]] | None = None
    check: Callable[[Any, Any], None] | None = None
    tensor_parallel: Callable[[Any, Any, bool], None] | None = None
    pipeline: Any = None
    attention_heads: Callable[[Any], int] | None = None
    sampler: Callable[[Any, Built], Callable[[str, Any, Any], str]] | None = None
    objective: ObjectiveSpec | None = None

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
    objective: Any = None  # the built `fntrain.step.objective.Objective` (None: the recipe's loss and forward)


