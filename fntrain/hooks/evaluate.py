"""Evaluation [S32]: every `eval_every` steps and/or `eval_epochs` epochs, at most once per global step.

`make_eval_fn` builds the standard evaluation of a language model over a validation split: the split is
read in order and sharded across data-parallel ranks (rank r reads samples r, r + world, ...), every rank
runs the same number of forwards (ranks short of samples repeat one with weight 0, so FSDP's collectives
stay matched), with no grad and the model in eval mode (its previous mode restored after, even on error).
Each micro-batch's mean loss is weighted by its valid tokens (by its samples when training weights them
so) and the sums are reduced across ranks with one collective: `val_loss` is the exact weighted mean over
the whole split, `val_ppl` its exp; an objective's metrics (a loss returning `(loss, metrics)`) are
reported as `val_<name>` instead of the perplexity. The cadence's settings: `fntrain.hooks.evaluate_config`.

`evaluate_hook` calls any such function on its cadence (on every rank: evaluation takes part in
collectives) and writes the result as its own record through the run's `MetricsLog` (rank 0), since it
runs after the metrics hook: metrics.jsonl then holds a `val_loss` line for that step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from fntrain.config import require_int
from fntrain.data.device import to_device
from fntrain.data.tokens import IGNORE_INDEX, count_loss_tokens, count_samples
from fntrain.hooks.base import StatefulHook, cadence, chain, every_epoch, on, on_steps, stateful
from fntrain.hooks.evaluate_config import EvaluateConfig
from fntrain.hooks.metrics_log import RESERVED, MetricsLog, format_record
from fntrain.loop import Event
from fntrain.runtime.collectives import exact_dtype, reduce_scalars
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from fntrain.step import default_forward

__all__ = ["EvaluateConfig", "EvalParts", "evaluate_hook", "make_eval_fn", "eval_index_groups"]

log = logging.getLogger("fntrain.hooks.evaluate")


def eval_index_groups(
    length: int, micro_batch_size: int, rank: int, world_size: int, max_batches: int = 0
) -> list[tuple[list[int], bool]]:
    """This rank's evaluation micro-batches as (sample indices, counted) pairs, in order.

    Rank r reads samples r, r + world, ... (each sample once over all ranks). Every rank gets the same
    number of micro-batches, ceil(ceil(length / world) / micro_batch_size) capped at `max_batches` when
    > 0; a rank that has run out repeats a real sample in an uncounted micro-batch.
    """
    if length < 1:
        raise ValueError("the validation split is empty")
    require_int("evaluate.micro_batch_size", micro_batch_size, min=1)
    mine = list(range(rank, length, world_size))
    count = math.ceil(math.ceil(length / world_size) / micro_batch_size)
    if max_batches > 0:
        count = min(count, max_batches)
    filler = mine[:1] or [0]
    groups = []
    for index in range(count):
        chunk = mine[index * micro_batch_size : (index + 1) * micro_batch_size]
        groups.append((chunk, True) if chunk else (filler, False))
    return groups


@dataclass(frozen=True)
class EvalParts:
    """How one evaluation micro-batch is made, run and weighted (None: the defaults)."""

    collate_fn: Callable[[list[Any]], Any] | None = None
    """Samples -> micro-batch (None: torch's default_collate)."""
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] | None = None
    """(model, micro-batch) -> output (None: `default_forward`)."""
    autocast_dtype: torch.dtype | None = None
    """Run the forward under autocast to this dtype (None: no autocast)."""
    ignore_index: int = IGNORE_INDEX
    """Label value that marks a position without loss (for the token weights)."""
    weighting: str = "token"
    """How micro-batches are weighted, as the training step weights them (`train.loss_weighting`):
    "token", by their loss tokens; "mean", by their samples (a loss that is a mean over samples, e.g. DPO's
    over pairs)."""


def make_eval_fn(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    dataset: Any,
    *,
    micro_batch_size: int,
    runtime: Runtime,
    max_batches: int = 0,
    parts: EvalParts = EvalParts(),
    group: Any = None,
) -> Callable[[], dict[str, float]]:
    """`eval_fn() -> {"val_loss", "val_ppl"}` over `dataset` (map-style), sharded over data-parallel ranks.

    `loss_fn(output, micro_batch)` must return the mean loss over the micro-batch's valid tokens (like
    `causal_lm_loss`); it is weighted by `count_loss_tokens` (`parts.weighting` "mean": a mean over its
    samples, weighted by `count_samples`). A loss returning an objective's `(loss,
    metrics)` adds "val_<name>" for each metric (weighted like the loss) instead of "val_ppl". Must be
    called on every rank of `group`.
    """
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"the validation dataset must be map-style (__getitem__ and __len__), got {type(dataset)!r}"
        )
    groups = eval_index_groups(len(dataset), micro_batch_size, runtime.dp_rank, runtime.dp_size, max_batches)
    parts = dataclasses.replace(parts, collate_fn=parts.collate_fn or default_collate,
                                forward=parts.forward or default_forward)  # fmt: skip
    device = runtime.device

    def eval_fn() -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                sums = _loss_sums(model, loss_fn, dataset, groups, parts, device)
            totals = reduce_scalars(sums, "sum", device=device, dtype=exact_dtype(device), group=group)
        finally:
            model.train(was_training)
        return _val_metrics(totals)

    return eval_fn


def _loss_sums(
    model: torch.nn.Module, loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor], dataset: Any,
    groups: list[tuple[list[int], bool]], parts: EvalParts, device: torch.device,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """{"loss": sum of loss x tokens, "tokens": loss tokens} over this rank's micro-batches, on the device,
    and for a loss returning `(loss, metrics)` each metric's sum x tokens (every rank computes the same
    names: the objective's loss returns them for every micro-batch)."""
    dtype = exact_dtype(device)
    loss_sum = torch.zeros((), dtype=dtype, device=device)
    token_sum = torch.zeros((), dtype=dtype, device=device)
    sums: dict[str, torch.Tensor] = {}
    for indices, counted in groups:
        micro_batch = to_device(parts.collate_fn([dataset[i] for i in indices]), device)
        if parts.autocast_dtype is not None:
            with torch.autocast(device.type, dtype=parts.autocast_dtype):
                output = parts.forward(model, micro_batch)
        else:
            output = parts.forward(model, micro_batch)
        loss, metrics = _loss_and_metrics(loss_fn(output, micro_batch))
        if counted:  # a filler micro-batch only keeps the ranks' forwards matched
            tokens = _weight(micro_batch, parts).to(dtype)
            loss_sum += loss.detach().to(dtype) * tokens
            token_sum += tokens
        for name, value in metrics.items():  # a filler adds 0, so every rank reduces the same names
            key = _METRIC + name
            total = sums.get(key, torch.zeros((), dtype=dtype, device=device))
            sums[key] = total + value.detach().to(dtype) * tokens if counted else total
    return {"loss": loss_sum, "tokens": token_sum, **sums}


def _weight(micro_batch: Mapping[str, Any], parts: EvalParts) -> torch.Tensor:
    """A micro-batch's weight in the means: its loss tokens, or (weighting "mean") its samples."""
    if parts.weighting == "mean":
        return torch.tensor(count_samples(micro_batch))
    return count_loss_tokens(micro_batch, parts.ignore_index)


_METRIC = "metric:"  # the sums of an objective's metrics, beside the loss's


def _loss_and_metrics(result: Any) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """A loss's result as (loss, metrics): an objective's `(loss, metrics)`, or a bare loss and none."""
    return result if type(result) is tuple else (result, {})


def _val_metrics(totals: Mapping[str, float]) -> dict[str, float]:
    """val_loss (the token-weighted mean) and val_ppl from the reduced sums; NaN without loss tokens."""
    if totals["tokens"] <= 0:
        log.warning("evaluation: the validation split has no valid loss tokens")
        return {"val_loss": math.nan, "val_ppl": math.nan}
    val_loss = totals["loss"] / totals["tokens"]
    grouped = {f"val_{key[len(_METRIC):]}": value / totals["tokens"] for key, value in totals.items()
               if key.startswith(_METRIC)}  # fmt: skip
    if grouped:  # an objective's loss (DPO, KD) is no cross-entropy: no perplexity, its metrics instead
        return {"val_loss": val_loss, **grouped}
    try:
        val_ppl = math.exp(val_loss)
    except OverflowError:
        val_ppl = math.inf
    return {"val_loss": val_loss, "val_ppl": val_ppl}


@dataclass(slots=True)
class _EvaluateMemory:
    """What the evaluation hook remembers between events."""

    evaluated: int = -1  # the global step of the last evaluation


def evaluate_hook(
    config: EvaluateConfig,
    eval_fn: Callable[[], Mapping[str, float]],
    runtime: Runtime,
    *,
    writer: MetricsLog | None = None,
    last_step: int | None = None,
) -> StatefulHook:
    """The evaluation hook: `eval_fn()` at STEP_END every `eval_every` steps (and at `last_step` with
    `at_end`), at EPOCH_END after every `eval_epochs`-th epoch, never twice for one global step (the
    evaluated step survives a resume: state name "evaluate"). Runs on every rank; the result is written
    through `writer` (rank 0), or logged when there is none.
    """
    config.validate()
    if config.at_end and last_step is None:
        raise ValueError("evaluate.at_end needs the run's last step (last_step=plan.train_iters)")
    memory = _EvaluateMemory()

    def evaluate(state: TrainState, info: Any) -> None:
        if state.global_step == memory.evaluated:
            return
        memory.evaluated = state.global_step
        started = time.perf_counter()
        metrics = dict(eval_fn())
        for name in RESERVED:
            if name in metrics:
                raise ValueError(f"metric name collision: {name!r} is reserved for the record's position")
        if runtime.rank == 0:
            log.info("evaluation at step %d took %.2fs", state.global_step, time.perf_counter() - started)
        if writer is not None:
            writer.write(state.global_step, state.epoch, metrics)
        elif runtime.rank == 0:
            log.info("%s", format_record(state.global_step, state.epoch, metrics))

    steps_due = cadence(config.eval_every, last_step if config.at_end else None)
    parts = [on_steps(steps_due, on(Event.STEP_END, evaluate))]
    if config.eval_epochs:
        parts.append(every_epoch(config.eval_epochs, on(Event.EPOCH_END, evaluate)))
    hook = chain(*parts)

    def state_dict() -> dict[str, Any]:
        return {"last_step": memory.evaluated}

    def load_state_dict(saved: Mapping[str, Any]) -> None:
        memory.evaluated = int(saved.get("last_step", -1))

    return stateful("evaluate", hook, state_dict, load_state_dict)
