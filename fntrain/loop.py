"""`train`: the one training loop, a fold of a step function and hooks over `TrainState`. No torch.

The loop owns the transitions of `TrainState`, the dispatch of events to hooks (list order), the ABORT
path and the lifetime of each epoch's data iterator. It knows nothing of models, devices or files, and it
never calls `.item()`, `.cpu()` or a device synchronize: metrics pass through as the step returned them.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fntrain.state import RunPlan, TrainState

__all__ = ["Event", "Hook", "StepInfo", "StopTraining", "TrainResult", "train"]

log = logging.getLogger("fntrain.loop")


class Event(enum.Enum):
    TRAIN_BEGIN = "train_begin"
    EPOCH_BEGIN = "epoch_begin"
    STEP_BEGIN = "step_begin"
    STEP_END = "step_end"
    EPOCH_END = "epoch_end"
    TRAIN_END = "train_end"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What STEP_END hooks get: the step's metrics (possibly device tensors), batch size, host wall time.

    `tokens` and `samples` come from the loop's `count_batch` (0 when none was given); `tokens` may be
    a device tensor. `step_time_s` is the host time spent in `step_fn` (no device sync is made, so on an
    asynchronous device it is dispatch time; hooks that report throughput sync on their logging steps).
    """

    metrics: Mapping[str, Any]
    tokens: Any = 0
    samples: int = 0
    step_time_s: float = 0.0


class Hook(Protocol):
    """A hook is any callable of (event, state, info). ABORT's info is the exception."""

    def __call__(self, event: Event, state: TrainState, info: StepInfo | BaseException | None) -> None: ...


Outcome = Literal["completed", "stopped", "preempted", "interrupted"]


class StopTraining(Exception):
    """Raised by a hook or a step to end the run cleanly: TRAIN_END is sent and `train` returns.

    `outcome` says why the run ended early ("stopped"; the checkpoint hook says "preempted" or
    "interrupted") and
    `exit_code` the status a launcher should exit with after its clean teardown (0: success)."""

    def __init__(self, reason: str = "", *, outcome: Outcome = "stopped", exit_code: int = 0):
        super().__init__(reason)
        self.reason, self.outcome, self.exit_code = reason, outcome, exit_code


@dataclass(frozen=True)
class TrainResult:
    """How a run ended: the final state, "completed" (train_iters reached), "stopped", "preempted" or
    "interrupted" (a `StopTraining` from a hook or the step), its reason, and the exit status it asks for."""

    state: TrainState
    outcome: Outcome = "completed"
    reason: str = ""
    exit_code: int = 0


StepFn = Callable[[TrainState, Any], Mapping[str, Any]]
DataFn = Callable[[int, int], Iterator[Any]]
CountFn = Callable[[Any], "tuple[Any, int]"]

_EXHAUSTED = object()


def _close(iterator: Any) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def train(
    state: TrainState,
    step_fn: StepFn,
    hooks: Sequence[Hook] = (),
    *,
    data: DataFn,
    plan: RunPlan,
    count_batch: CountFn | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TrainResult:
    """Run `step_fn` over `data` from `state` until `plan.train_iters` steps; return how it ended.

    Events, in order: TRAIN_BEGIN; per epoch EPOCH_BEGIN, then per step STEP_BEGIN (after the batch was
    fetched), the step, the state advances, STEP_END (with a `StepInfo`); EPOCH_END (with the finished
    epoch's state); finally TRAIN_END. Any exception sends ABORT (info = the exception) to every hook,
    closes the data iterator and re-raises the same exception object; TRAIN_END is then not sent.
    `StopTraining` ends the run cleanly; the returned `TrainResult` (its `state` the final `TrainState`)
    says how the run ended. `data(epoch, cursor)` returns the epoch's remaining global batches; running
    out early ends the epoch quietly without advancing `global_step` [S13].
    """
    return _fold(tuple(hooks), state, step_fn, data, plan, count_batch, clock)


def _fold(
    hooks: tuple[Hook, ...],
    state: TrainState,
    step_fn: StepFn,
    data: DataFn,
    plan: RunPlan,
    count_batch: CountFn | None,
    clock: Callable[[], float],
) -> TrainResult:
    """`train`'s fold, in one frame: the ABORT path sees the latest state with no per-step bookkeeping."""
    iterator: Iterator[Any] | None = None

    def dispatch(event: Event, current: TrainState, info: Any = None) -> None:
        for hook in hooks:
            hook(event, current, info)

    try:
        try:
            dispatch(Event.TRAIN_BEGIN, state)
            while state.global_step < plan.train_iters:
                steps = plan.steps_in_epoch(state)
                if steps > 0:
                    dispatch(Event.EPOCH_BEGIN, state)
                    started_at = state.cursor
                    iterator = iter(data(state.epoch, state.cursor))
                    for _ in range(steps):
                        batch = next(iterator, _EXHAUSTED)
                        if batch is _EXHAUSTED:
                            _out_of_data(state, plan, started_at)
                            steps = -1
                            break
                        dispatch(Event.STEP_BEGIN, state)
                        t0 = clock()
                        metrics = step_fn(state, batch)
                        elapsed = clock() - t0
                        state = state.after_step()
                        if count_batch is None:
                            info = StepInfo(metrics, 0, 0, elapsed)
                        else:
                            info = StepInfo(metrics, *count_batch(batch), elapsed)
                        dispatch(Event.STEP_END, state, info)
                    _close(iterator)
                    iterator = None
                    if steps != -1 and state.cursor < plan.steps_per_epoch:
                        break  # train_iters reached mid-epoch: the epoch is not finished
                # The epoch is finished (all its steps, its data ran out, or a restored cursor at its end).
                dispatch(Event.EPOCH_END, state)
                state = state.next_epoch()
            ended = TrainResult(state)
        except StopTraining as stop:
            log.info("StopTraining at global_step %d; ending the run", state.global_step)
            ended = TrainResult(state, stop.outcome, stop.reason, stop.exit_code)
        if iterator is not None:
            _close(iterator)
            iterator = None
        dispatch(Event.TRAIN_END, state)
        return ended
    except BaseException as error:
        _abort(hooks, state, error, iterator)
        raise


def _out_of_data(state: TrainState, plan: RunPlan, started_at: int) -> None:
    """The epoch's data ran out before its steps: log it, or raise when the epoch yielded nothing at all."""
    log.info(
        "epoch %d ran out of data after %d of %d steps; ending the epoch",
        state.epoch, state.cursor, plan.steps_per_epoch,
    )  # fmt: skip
    if state.cursor == started_at == 0:
        raise RuntimeError(
            f"data(epoch={state.epoch}, cursor=0) yielded no batch: an empty epoch would repeat forever"
        )


def _abort(hooks: tuple[Hook, ...], state: TrainState, error: BaseException, iterator: Any) -> None:
    """Send ABORT to every hook and close the data; nothing raised here may hide `error`."""
    for hook in hooks:
        try:
            hook(Event.ABORT, state, error)
        except BaseException as hook_error:  # noqa: BLE001 - logged, the original error wins
            log.error("hook %r raised during ABORT: %r", hook, hook_error)
    if iterator is not None:
        try:
            _close(iterator)
        except BaseException as close_error:  # noqa: BLE001
            log.error("closing the data iterator during ABORT raised: %r", close_error)
