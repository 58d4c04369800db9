"""Behaviours of the metrics hook that mutation testing found unpinned (mutation/RESULTS.md): log_every 1
logs every step; a bad log_every or last_step is an error naming the setting and the value, and the
smallest valid last_step is accepted; a non-scalar loss or grad_norm and a metric that is not a number
are errors naming the metric, the shape or the type; the step's metrics are reduced on the run's
device; TRAIN_END and ABORT close the sinks with the summary (an abort's says so)."""

from __future__ import annotations

import pytest
import torch

from fntrain.hooks import metrics as metrics_module
from fntrain.hooks.metrics import is_logging_step, metrics_hook
from fntrain.hooks.metrics_log import MetricsLog
from fntrain.loop import Event, StepInfo
from fntrain.runtime.collectives import reduce_scalars
from fntrain.runtime.runtime import Runtime
from tests.hooks.drive import drive
from tests.hooks.test_metrics import info, run_metric_steps, step_state


class RecordingSink:
    """A sink that keeps what it is sent: records, summaries and closes."""

    def __init__(self):
        self.records, self.summaries, self.closed = [], [], 0

    def write(self, step, record):
        self.records.append(dict(record))

    def log_config(self, config, tags):
        pass

    def summary(self, values):
        self.summaries.append(dict(values))

    def close(self):
        self.closed += 1


def recorded_logs(log_every: int, steps: int, end: Event | None = None, last_step: int | None = None):
    sink = RecordingSink()
    hook = metrics_hook(Runtime(), log_every=log_every, writer=MetricsLog(enabled=True, sinks=[sink]),
                        last_step=last_step)  # fmt: skip
    drive(hook, steps, info=lambda state: info(), end=end)
    return sink


@pytest.mark.parametrize("log_every, steps", [(1, [1, 2, 3, 4]), (2, [2, 4]), (3, [3])])
def test_log_every_n_logs_each_nth_step(log_every, steps):
    assert [s for s in range(1, 5) if is_logging_step(s, log_every)] == steps
    assert [r["step"] for r in recorded_logs(log_every, 4).records] == steps


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"log_every": -1}, ValueError, "log_every must be >= 0, got -1"),
        ({"log_every": 1, "last_step": 0}, ValueError, "last_step must be >= 1, got 0"),
        ({"log_every": 1, "last_step": "5"}, TypeError, "last_step must be an int, got '5'"),
    ],
)
def test_a_bad_setting_is_an_error_naming_it_and_its_value(kwargs, error, message):
    with pytest.raises(error) as raised:
        metrics_hook(Runtime(), writer=MetricsLog(enabled=False), **kwargs)
    assert str(raised.value) == message


def test_the_smallest_last_step_is_accepted_and_logs():
    assert [r["step"] for r in recorded_logs(5, 1, last_step=1).records] == [1]


@pytest.mark.parametrize("name", ["loss", "grad_norm"])
@pytest.mark.parametrize("log_every", [1, 4])
def test_a_non_scalar_loss_or_grad_norm_is_an_error_naming_it_and_its_shape(name, log_every):
    hook = metrics_hook(Runtime(), log_every=log_every, writer=MetricsLog(enabled=False), last_step=1)
    metrics = {"loss": torch.tensor(1.0), "grad_norm": torch.tensor(0.5), name: torch.ones(2, 3)}
    with pytest.raises(ValueError) as raised:
        hook(Event.STEP_END, step_state(1), StepInfo(metrics))
    assert str(raised.value) == f"metric {name!r} must be a scalar, got a tensor of shape (2, 3)"


@pytest.mark.parametrize("value, kind", [("text", "str"), (None, "NoneType"), ([1.0], "list")])
def test_a_metric_that_is_not_a_number_is_an_error_naming_its_type(value, kind):
    hook = metrics_hook(Runtime(), log_every=1, writer=MetricsLog(enabled=False))
    with pytest.raises(TypeError) as raised:
        hook(Event.STEP_END, step_state(1), StepInfo({"note": value}))
    assert str(raised.value) == f"metric 'note' must be a number or a scalar tensor, got {kind}"


def test_the_step_metrics_are_reduced_on_the_runs_device(monkeypatch):
    """A collective backend reduces tensors on its own device only (NCCL: CUDA), so the reduction
    stacks on the run's device even when the step's first tensor metric lives elsewhere."""
    devices = []

    def recording_reduce(values, op="mean", *, device=None, **kwargs):
        devices.append(device)
        return reduce_scalars(values, op, **kwargs)

    monkeypatch.setattr(metrics_module, "reduce_scalars", recording_reduce)
    runtime = Runtime(device=torch.device("meta"))
    hook = metrics_hook(runtime, log_every=2, writer=MetricsLog(enabled=False))
    run_metric_steps(hook, 4)
    assert devices == [torch.device("meta")] * 2


@pytest.mark.parametrize("end, outcome", [(Event.TRAIN_END, {}), (Event.ABORT, {"outcome": "aborted"})])
def test_the_end_of_a_run_closes_the_sinks_with_the_summary(end, outcome):
    sink = recorded_logs(2, 3, end=end)
    assert sink.summaries == [
        {"step": 2, "grad_norm": 0.75, "loss": 2.5, "loss_last": 2.5, "lr": 3e-4, **outcome}
    ]
    assert sink.closed == 1
