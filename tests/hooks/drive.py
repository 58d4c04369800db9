"""The one event-driving helper of the hook tests: a run's events, sent to a list of hooks by hand."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fntrain.loop import Event, Hook, StepInfo
from fntrain.state import TrainState

InfoArg = StepInfo | Callable[[TrainState], StepInfo | None] | None


def send(hooks: Hook | Sequence[Hook], event: Event, state: TrainState, info: Any = None) -> None:
    """`event` to each of `hooks` (one hook or a list), in order, as the loop sends it."""
    for hook in hooks if isinstance(hooks, (list, tuple)) else (hooks,):
        hook(event, state, info)


def drive(
    hooks: Hook | Sequence[Hook],
    steps: int = 0,
    *,
    start: TrainState | None = None,
    info: InfoArg = None,
    begin: bool = True,
    end: Event | None = Event.TRAIN_END,
    error: BaseException | None = None,
    epoch_events: bool = False,
) -> TrainState:
    """Send `hooks` the events of `steps` steps from `start` (default: a fresh TrainState) and return the
    state after the last one: TRAIN_BEGIN (when `begin`), EPOCH_BEGIN (when `epoch_events`), then per
    step STEP_BEGIN at the state before it and STEP_END at `state.after_step()` with `info` (a StepInfo,
    or a function of the new state returning one; default: `StepInfo({})`), EPOCH_END (when
    `epoch_events`), then `end`: TRAIN_END, ABORT (info: `error`, default RuntimeError("boom")) or None.
    """
    state = start if start is not None else TrainState()
    if begin:
        send(hooks, Event.TRAIN_BEGIN, state)
    if epoch_events:
        send(hooks, Event.EPOCH_BEGIN, state)
    for _ in range(steps):
        send(hooks, Event.STEP_BEGIN, state)
        state = state.after_step()
        step_info = info(state) if callable(info) else info
        send(hooks, Event.STEP_END, state, step_info if step_info is not None else StepInfo({}))
    if epoch_events:
        send(hooks, Event.EPOCH_END, state)
    if end is Event.ABORT:
        send(hooks, Event.ABORT, state, error if error is not None else RuntimeError("boom"))
    elif end is not None:
        send(hooks, end, state)
    return state


def torch_op_recorder() -> Any:
    """A TorchFunctionMode that records every torch function called inside it (`.calls`): a test
    shows a hook does no device work (and so no host sync) on a step by finding `.calls` empty."""
    from torch.overrides import TorchFunctionMode

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    return Recorder()


def state_at(step: int, epoch: int = 0) -> TrainState:
    """The state a run is in after `step` optimizer steps (its cursor at `step`), in `epoch`."""
    return TrainState(epoch=epoch, global_step=step, cursor=step)
