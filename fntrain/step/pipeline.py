"""`make_pipeline_step`: one optimizer step through a pipeline schedule (GPipe or 1F1B) [issue 20].

The same contract as `fntrain.step.train_step.make_train_step`: `step_fn(state, batch) -> {"loss", "grad_norm",
"lr", "loss_tokens"}` for the micro-batches of one global step, token-weighted [S23], clipped [S24], optimizers then
schedulers [S25]. What differs is who computes what:

- the step's micro-batches are the pipeline's micro-batches (torch.distributed.pipelining runs them
  through the stages by the schedule, sending activations forward and gradients back);
- only the last stage computes the loss: each micro-batch's loss times its token weight (the same
  weights as in data parallelism, so the gradients are those of one big batch); the reported loss is
  then summed over the pipeline group so every rank reports the same number (one small all_reduce);
- a weight tied across stages (an output head sharing the token embedding) has a copy on two stages: the
  copies' gradients are added before clipping, so both copies take the same update as the single tensor
  of a one-rank run;
- the gradient norm for clipping is the norm over all stages (squares summed over the pipeline group,
  a tied copy counted once), which torch's clip_grad_norm_ cannot know about.

The schedule's `step()` takes whole-batch inputs and splits them into its micro-batches, so the first
stage concatenates the step's micro-batches (fixed-shape: the stages' buffers are shaped by the first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fntrain.data.device import to_device
from fntrain.runtime.groups import pipeline_group
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from fntrain.step.settings import StepSettings, check_settings
from fntrain.step.train_step import (
    _autocast_context,
    _check_zero_tokens,
    _make_nonfinite_check,
    _make_token_weights,
)
from fntrain.step.update import _make_update

__all__ = ["PipelineLayout", "pipeline_layout", "make_pipeline_step", "make_pipeline_eval", "build_schedule"]


@dataclass(frozen=True)
class PipelineLayout:
    """This rank's place in the pipeline: its stage, the number of stages, the pipeline process group
    (this rank's peers in the other stages), the schedule name, and for each weight tied across stages
    the parameter name this stage holds it under and the process group of the stages that hold it."""

    stage: int
    stages: int
    group: Any
    schedule: str = "1f1b"
    ties: tuple[tuple[str, Any], ...] = ()
    tie_counted_here: tuple[bool, ...] = ()

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def build_schedule(model: torch.nn.Module, layout: PipelineLayout, device: torch.device, micro_batches: int,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Any:  # fmt: skip
    """A torch pipeline schedule (GPipe or 1F1B) over this rank's stage of `model`; forward-only (GPipe)
    when `loss_fn` is None. Gradients are not divided by the micro-batch count (`scale_grads=False`):
    the loss weights already make them exact."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(model, layout.stage, layout.stages, device, group=layout.group)
    if loss_fn is None:  # forward only: there is no backward to interleave
        return ScheduleGPipe(stage, micro_batches)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[layout.schedule]
    return kind(stage, micro_batches, loss_fn=loss_fn, scale_grads=False)


def _stage_inputs(micro_batches: Sequence[Mapping[str, Any]]) -> tuple[tuple, dict]:
    """The first stage's whole-batch positional and keyword inputs (the schedule splits them again)."""
    shapes = {tuple(mb["input_ids"].shape) for mb in micro_batches}
    if len(shapes) > 1:
        raise ValueError(
            f"pipeline parallelism needs micro-batches of one shape, got {sorted(shapes)}: pad every "
            "micro-batch to the same length or use --parallel.pp-size 1"
        )
    if any(mb.get("attention_mask") is not None and mb["attention_mask"].dim() == 4 for mb in micro_batches):
        raise ValueError(
            "pipeline parallelism runs micro-batches without per-document attention masks: "
            "turn packing off or use --parallel.pp-size 1"
        )
    ids = torch.cat([mb["input_ids"] for mb in micro_batches])
    if "position_ids" not in micro_batches[0]:
        return (ids,), {}
    return (ids,), {"position_ids": torch.cat([mb["position_ids"] for mb in micro_batches])}


def _global_grad_norm(params: list[torch.Tensor], counted: list[bool], group: Any) -> torch.Tensor:
    """The 2-norm of all stages' gradients: each stage's squared norm (DTensor shards gathered), summed
    over the pipeline group. `counted[i]` False leaves params[i] out (the second copy of a tied weight)."""
    grads = [p.grad for p, keep in zip(params, counted, strict=True) if keep and p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if hasattr(local, "full_tensor"):
        local = local.full_tensor()
    squared = local.float() ** 2
    dist.all_reduce(squared, group=group)
    return squared.sqrt()


def _add_tied_grads(model: torch.nn.Module, layout: PipelineLayout) -> None:
    """Sum each cross-stage tied weight's gradient copies, so every copy holds the full gradient. A
    DTensor gradient is first laid out like its parameter (an embedding's may come back partial or
    replicated while the output head's is sharded), so the copies' local tensors line up."""
    for name, group in layout.ties:
        param = model.get_parameter(name)
        grad = param.grad
        if grad is None:
            continue
        if hasattr(grad, "redistribute") and grad.placements != param.placements:
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)


def _make_finish_gradients(
    model: torch.nn.Module,
    layout: PipelineLayout,
    params: list[torch.Tensor],
    max_grad_norm: float,
    needs_norm: bool,
) -> Callable[[], Any]:
    """`finish_gradients() -> grad_norm` after the schedule: add the tied copies' gradients, then the
    global norm over all stages (a tied copy counted once) and clipping; 0.0 when no norm is needed."""
    tied = {
        id(model.get_parameter(name)): here
        for (name, _), here in zip(layout.ties, layout.tie_counted_here, strict=True)
    }
    counted = [tied.get(id(p), True) for p in params]

    def finish_gradients() -> Any:
        _add_tied_grads(model, layout)
        if not needs_norm:
            return 0.0
        grad_norm = _global_grad_norm(params, counted, layout.group)
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm)
        return grad_norm

    return finish_gradients


@dataclass
class _StepRecord:
    """The step in progress, as the last stage's loss function sees it: the micro-batches and their
    weights (the schedule hands the loss function a tensor target only, so the target is the
    micro-batch's index), and the losses it computed, by micro-batch: raw, for the zero-token check,
    and weighted. Stored by position because the schedule's first step also calls the loss function
    once on a placeholder output to learn the gradients' shapes; the real micro-batch 0 overwrites it."""

    micro_batches: list[Mapping[str, Any]]
    weights: Any
    raw: list[Any]
    weighted: list[Any]

    def start(self, micro_batches: list[Mapping[str, Any]], weights: Any) -> None:
        self.micro_batches, self.weights = micro_batches, weights
        self.raw = [None] * len(micro_batches)
        self.weighted = [None] * len(micro_batches)


def _weighted_loss(
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor], record: _StepRecord
) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The last stage's loss function for the schedule: micro-batch `index`'s loss times its weight,
    both losses kept in `record`."""

    def weighted_loss(output: Any, index: torch.Tensor) -> torch.Tensor:
        position = int(index)  # a host tensor the step made: reading it costs no device sync
        loss = loss_fn(output, record.micro_batches[position])
        record.raw[position] = loss.detach()
        weighted = loss * record.weights[position]
        record.weighted[position] = weighted.detach()
        return weighted

    return weighted_loss


def make_pipeline_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    layout: PipelineLayout,
    *,
    settings: StepSettings = StepSettings(),
    micro_batches: int,
) -> Callable[[TrainState, Sequence[Mapping[str, Any]]], dict[str, Any]]:
    """Build `step_fn(state, batch)` for this rank's pipeline stage `model` (see the module doc).

    Every rank of the pipeline gets the same `batch` of `micro_batches` micro-batches (the data is
    sharded by the data-parallel coordinate only); the first stage feeds `input_ids` (and
    `position_ids`), the last computes `loss_fn(output, micro_batch)`. `settings.loss_context` wraps the
    whole schedule (vocabulary-parallel loss needs torch's `loss_parallel()` around forward and
    backward). Settings otherwise as for `make_train_step` (no gradient scaler: use bf16, not fp16).
    """
    check_settings(settings)
    params = [p for p in model.parameters() if p.requires_grad]
    device = settings.device if settings.device is not None else params[0].device
    record = _StepRecord([], None, [], [])
    token_weights = _make_token_weights(device, settings.dp_size, settings.dp_group, settings.ignore_index)
    token_weighted, loss_context = settings.loss_weighting == "token", settings.loss_context
    schedule = build_schedule(model, layout, device, micro_batches, _weighted_loss(loss_fn, record))
    indices = torch.arange(micro_batches)  # the schedule splits it into one index per micro-batch
    skip_mode = settings.nonfinite == "skip"
    needs_norm = settings.max_grad_norm > 0 or skip_mode  # skipping decides on the global norm (same on all ranks)
    should_skip = _make_nonfinite_check(params, device.type == "cpu", skip_mode, needs_norm, None, settings.dp_size)
    finish_gradients = _make_finish_gradients(model, layout, params, settings.max_grad_norm, needs_norm)
    update = _make_update(tuple(optimizers), tuple(schedulers), None, skip_mode)
    # Autocast covers the whole schedule (its forwards and backwards interleave); backward ops run in the
    # dtype their forward used either way. Under fsdp2 the MixedPrecisionPolicy casts instead (no autocast).
    autocast = _autocast_context(device.type, settings.autocast_dtype)

    def step_fn(state: TrainState, batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        mbs = [batch] if isinstance(batch, Mapping) else list(batch)
        if len(mbs) != micro_batches:
            raise ValueError(
                f"step {state.global_step + 1}: {len(mbs)} micro-batches, the pipeline runs {micro_batches}"
            )
        if device.type != "cpu":
            mbs = [to_device(mb, device) for mb in mbs]
        if token_weighted:
            weights, total = token_weights(mbs)
        else:
            weights = torch.full((len(mbs),), 1.0 / len(mbs), device=device)
        args, kwargs = _stage_inputs(mbs) if layout.first else ((), {})
        record.start(mbs, weights)
        with loss_context(), autocast():
            schedule.step(*args, target=indices if layout.last else None, return_outputs=False, **kwargs)
        reported = torch.stack(record.weighted).sum() if layout.last else torch.zeros((), device=device)
        dist.all_reduce(reported, group=layout.group)  # every stage reports the step's loss
        if token_weighted and layout.last:
            _check_zero_tokens(state, total, record.raw, device.type == "cpu")
        grad_norm = finish_gradients()
        skip = should_skip(state.global_step + 1, reported, grad_norm)
        return update(reported, grad_norm, skip, total if token_weighted else None)

    return step_fn


def make_pipeline_eval(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    layout: PipelineLayout,
    device: torch.device,
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[
    Callable[[torch.nn.Module, Mapping[str, Any]], Any], Callable[[Any, Mapping[str, Any]], torch.Tensor]
]:
    """`(forward, loss_fn)` for `fntrain.hooks.evaluate.make_eval_fn` under pipeline parallelism: the
    forward runs one micro-batch through every stage (a forward-only schedule per micro-batch shape,
    since a stage's buffers are shaped by its first micro-batch); the loss is computed on the last stage
    and summed over the pipeline group, so every rank returns the same loss."""
    schedules: dict[tuple[int, ...], Any] = {}

    def forward(_model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> Any:
        shape = tuple(micro_batch["input_ids"].shape)
        if shape not in schedules:
            schedules[shape] = build_schedule(model, layout, device, 1, None)
        args, kwargs = _stage_inputs([micro_batch]) if layout.first else ((), {})
        with loss_context():
            return schedules[shape].step(*args, **kwargs)

    def pipeline_loss(output: Any, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        if layout.last:
            with loss_context():
                loss = loss_fn(output, micro_batch).detach().float()
        else:
            loss = torch.zeros((), device=device)
        dist.all_reduce(loss, group=layout.group)
        return loss

    return forward, pipeline_loss


def pipeline_layout(runtime: Runtime, config: Any, ties: Sequence[Mapping[int, str]] = ()) -> Any:
    """This rank's `PipelineLayout`: stage, pipeline group, schedule, and for each weight tied across
    stages (`fntrain.runtime.pipeline.stage_ties`) this stage's name for it and the group of its holders."""
    group = pipeline_group(runtime)
    here: list[tuple[str, Any]] = []
    counted: list[bool] = []
    for holders in ties:
        tie_group = _holders_group(runtime, sorted(holders), group)
        if runtime.pp_rank in holders:
            here.append((holders[runtime.pp_rank], tie_group))
            counted.append(runtime.pp_rank == min(holders))
    return PipelineLayout(
        runtime.pp_rank, runtime.pp_size, group, config.pp_schedule, tuple(here), tuple(counted)
    )


def _holders_group(runtime: Runtime, stages: list[int], pp_group: Any) -> Any:
    """The process group joining `stages` of this rank's pipeline. Every rank must call this for every
    tie in the same order (`dist.new_group` is collective); all stages: the pipeline group itself."""
    if len(stages) == runtime.pp_size:
        return pp_group
    pp_dim = runtime.mesh.mesh_dim_names.index("pp")
    slices = runtime.mesh.mesh.movedim(pp_dim, -1).reshape(-1, runtime.pp_size).tolist()
    mine = None
    for ranks in slices:
        group = dist.new_group([ranks[stage] for stage in stages])
        if runtime.rank in ranks:
            mine = group
    return mine
