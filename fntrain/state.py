"""The explicit training state and the run-length plan: pure arithmetic, no torch.

`TrainState` is the only thing the loop threads from step to step; its transitions return new states.
`RunPlan` is what the run-length settings and the dataset length imply ([S5]-[S8]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TrainState", "RunPlan", "GenerationShape", "make_run_plan", "micro_batches_per_step"]


@dataclass(frozen=True, slots=True)
class TrainState:
    """Where a run stands: `cursor` is the number of optimizer steps already taken inside `epoch`."""

    epoch: int = 0
    global_step: int = 0
    cursor: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "global_step", "cursor"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"TrainState.{name} must be a non-negative int, got {value!r}")

    def after_step(self) -> TrainState:
        """The state after one more optimizer step inside the current epoch."""
        return TrainState(self.epoch, self.global_step + 1, self.cursor + 1)

    def next_epoch(self) -> TrainState:
        """The state at the start of the following epoch."""
        return TrainState(self.epoch + 1, self.global_step, 0)

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "global_step": self.global_step, "cursor": self.cursor}


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How long a run is, in optimizer steps.

    `epochs` is informative: the run ends when `global_step == train_iters` [S12].
    `steps_per_epoch` is in optimizer steps (not micro-batches); for an unsized dataset it equals
    `train_iters` and an epoch ends when the stream runs out [S7].
    """

    train_iters: int
    steps_per_epoch: int
    epochs: int
    micro_batches: int = 1
    global_batch_size: int = 1
    micro_batch_size: int = 1
    dp_size: int = 1
    lr_schedule_iters: int = 0
    sized: bool = True
    steps_per_read: int = 1
    """Optimizer steps each read batch serves: 1, or a generating objective's steps per generation batch
    (the data yields each batch that many times; the step uses it once and then its own buffer)."""

    def __post_init__(self) -> None:
        if self.train_iters < 1:
            raise ValueError(f"plan.train_iters must be >= 1, got {self.train_iters}")
        if self.steps_per_epoch < 1:
            raise ValueError(f"plan.steps_per_epoch must be >= 1, got {self.steps_per_epoch}")
        if self.lr_schedule_iters == 0:
            object.__setattr__(self, "lr_schedule_iters", self.train_iters)

    def steps_in_epoch(self, state: TrainState) -> int:
        """Steps the loop will run in `state.epoch` starting from `state.cursor` [S12]."""
        return max(0, min(self.steps_per_epoch - state.cursor, self.train_iters - state.global_step))


@dataclass(frozen=True, slots=True)
class GenerationShape:
    """How a generating objective reads its data: `prompts` rows per generation batch (every rank reads
    the same rows; each makes its share of the completions), each batch serving `steps` optimizer steps."""

    prompts: int
    steps: int

    def __post_init__(self) -> None:
        for name in ("prompts", "steps"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"GenerationShape.{name} must be a positive int, got {value!r}")


def micro_batches_per_step(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """global_batch_size / (micro_batch_size * dp_size), exactly, or a ValueError naming all three [S5]."""
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("dp_size", dp_size),
    ):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size "
            f"({micro_batch_size}) x data-parallel size ({dp_size}) = {per_step}"
        )
    return global_batch_size // per_step


def loader_length(dataset_len: int, micro_batch_size: int, dp_size: int, drop_last: bool) -> int:
    """Micro-batches one data-parallel rank sees per epoch (DistributedSampler + DataLoader semantics)."""
    per_rank = dataset_len // dp_size if drop_last else math.ceil(dataset_len / dp_size)
    return per_rank // micro_batch_size if drop_last else math.ceil(per_rank / micro_batch_size)


def make_run_plan(
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int = 1,
    train_iters: int | None = None,
    train_samples: int | None = None,
    dataset_len: int | None = None,
    drop_last: bool = True,
    lr_schedule_iters: int | None = None,
    generation: GenerationShape | None = None,
) -> RunPlan:
    """The run plan implied by the run-length settings [S5]-[S8].

    Exactly one of `train_iters` / `train_samples` is set; `dataset_len=None` means an unsized
    (streaming) dataset. A generating objective reads `generation.prompts` rows at a time (every rank
    the same rows), each read serving `generation.steps` optimizer steps: an epoch is then
    `dataset_len // generation.prompts` reads. Every error names the setting and its value.
    """
    micro_batches = micro_batches_per_step(global_batch_size, micro_batch_size, dp_size)
    train_iters = _train_iters(train_iters, train_samples, global_batch_size)
    if dataset_len is not None and (type(dataset_len) is not int or dataset_len < 0):
        raise ValueError(f"dataset_len must be a non-negative int, got {dataset_len!r}")
    if dataset_len is None:
        steps_per_epoch = train_iters
    elif generation is not None:
        steps_per_epoch = _generation_steps_per_epoch(dataset_len, generation)
    else:
        steps_per_epoch = _sized_steps_per_epoch(
            dataset_len, micro_batch_size, dp_size, drop_last, micro_batches
        )
    epochs = math.ceil(train_iters / steps_per_epoch)

    if lr_schedule_iters is None:
        lr_schedule_iters = train_iters
    elif type(lr_schedule_iters) is not int or lr_schedule_iters <= 0:
        raise ValueError(f"lr_schedule_iters must be a positive int, got {lr_schedule_iters!r}")

    return RunPlan(
        train_iters=train_iters,
        steps_per_epoch=steps_per_epoch,
        epochs=epochs,
        micro_batches=micro_batches,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_size=dp_size,
        lr_schedule_iters=lr_schedule_iters,
        sized=dataset_len is not None,
        steps_per_read=generation.steps if generation is not None else 1,
    )


def _train_iters(train_iters: int | None, train_samples: int | None, global_batch_size: int) -> int:
    """The run's optimizer steps from exactly one of `train_iters` / `train_samples` [S6]."""
    if (train_iters is None) == (train_samples is None):
        raise ValueError(
            "exactly one of train_iters / train_samples must be set, got "
            f"train_iters={train_iters!r}, train_samples={train_samples!r}"
        )
    if train_samples is not None:
        if type(train_samples) is not int or train_samples < 1:
            raise ValueError(f"train_samples must be a positive int, got {train_samples!r}")
        train_iters = train_samples // global_batch_size
        if train_iters < 1:
            raise ValueError(
                f"train_samples ({train_samples}) // global_batch_size ({global_batch_size}) "
                f"= {train_iters}: must give at least one optimizer step"
            )
    assert train_iters is not None
    if type(train_iters) is not int or train_iters < 1:
        raise ValueError(f"train_iters must be a positive int, got {train_iters!r}")
    return train_iters


def _sized_steps_per_epoch(
    dataset_len: int, micro_batch_size: int, dp_size: int, drop_last: bool, micro_batches: int
) -> int:
    """Complete optimizer steps one epoch of a sized dataset gives (at least one, or a ValueError) [S7]."""
    batches = loader_length(dataset_len, micro_batch_size, dp_size, drop_last)
    steps_per_epoch = batches // micro_batches
    if steps_per_epoch < 1:
        raise ValueError(
            f"the dataset ({dataset_len} samples, {batches} micro-batches of {micro_batch_size} per "
            f"rank) must provide one complete optimizer step per epoch ({micro_batches} micro-batches)"
        )
    return steps_per_epoch


def _generation_steps_per_epoch(dataset_len: int, generation: GenerationShape) -> int:
    """Optimizer steps one epoch of a generating objective gives: its whole generation batches, each
    serving `generation.steps` steps (at least one batch, or a ValueError)."""
    reads = dataset_len // generation.prompts
    if reads < 1:
        raise ValueError(
            f"the dataset ({dataset_len} prompts) must provide one complete generation batch per epoch "
            f"({generation.prompts} prompts)"
        )
    return reads * generation.steps
