"""Behaviours of the throughput meter that mutation testing found unpinned (mutation/RESULTS.md): the
rates are the interval's counts over its elapsed time (not only when it lasts 1 s), TFLOP/s and MFU are
exact in their units, restored pending counts are scaled to all data-parallel replicas and a state saved
without them resumes with none pending, the device peak comes from the runtime's own device, the
warnings and the FLOPs log line read as written, a disabled meter accepts a saved state, and the
config's value rules name their field."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from fntrain.hooks import throughput as throughput_module
from fntrain.hooks.base import load_hook_states
from fntrain.hooks.throughput import ThroughputConfig, throughput_meter
from fntrain.loop import Event
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.hooks.test_throughput import figures_by_step

LOGGER = "fntrain.hooks.throughput"
RANK_DEVICE = torch.device("cuda", 1)


def started_meter(config: ThroughputConfig, runtime: Runtime | None = None, **kwargs):
    meter = throughput_meter(config, runtime if runtime is not None else Runtime(), **kwargs)
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    return meter


class FakeDevice:
    """A device module (torch.cuda's seam) whose name depends on the device asked for: only the
    runtime's own device (cuda:1) is an H100; any other answer is an A100."""

    def __init__(self, name: str | None = "NVIDIA H100 80GB HBM3"):
        self.name = name

    def synchronize(self):
        pass

    def max_memory_allocated(self, device):
        return 2**30

    def get_device_name(self, device):
        if self.name is None:
            raise RuntimeError("driver gone")
        return self.name if device == RANK_DEVICE else "NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize(
    ("step_time", "every_n", "tokens", "samples", "tokens_per_s", "samples_per_s"),
    [(0.25, 2, 1000, 4, 4000.0, 16.0), (2.0, 2, 1000, 4, 500.0, 2.0), (0.5, 4, 30, 3, 60.0, 6.0)],
)
def test_rates_are_the_intervals_counts_over_its_elapsed_time(
    step_time, every_n, tokens, samples, tokens_per_s, samples_per_s
):
    meter = started_meter(ThroughputConfig(flops_per_token=1e12))
    figures = figures_by_step(meter, every_n, 1, every_n, tokens=tokens, samples=samples, step_time=step_time)[every_n]
    assert figures["tokens_per_s"] == tokens_per_s
    assert figures["samples_per_s"] == samples_per_s
    assert figures["tflops"] == tokens_per_s  # 1e12 FLOPs per token: TFLOP/s = tokens/s on one device


@pytest.mark.parametrize(
    ("fpt", "tokens", "world", "peak_tflops", "tflops", "mfu"),
    [(1e9, 2000, 2, 4.0, 2.0, 0.5), (3e9, 1000, 1, 12.0, 6.0, 0.5), (5e8, 4000, 4, 1.0, 1.0, 1.0)],
)
def test_tflops_and_mfu_are_exact_in_their_units(fpt, tokens, world, peak_tflops, tflops, mfu):
    """2 steps of 0.5 s, each `tokens` tokens on one replica: the figures are exact, not approximately
    right (TFLOP/s is 1e12 FLOP/s, the configured peak is in TFLOP/s)."""
    config = ThroughputConfig(flops_per_token=fpt, peak_tflops=peak_tflops)
    figures = figures_by_step(started_meter(config, Runtime(world_size=world)), 2, 1, 2, tokens=tokens, step_time=0.5)[2]
    assert (figures["tflops"], figures["mfu"]) == (tflops, mfu)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_restored_pending_counts_count_for_every_replica(dp_size):
    """A checkpoint holds this rank's counts of steps not yet logged; each replica had as many."""
    meter = throughput_meter(ThroughputConfig(), Runtime(world_size=dp_size, dp_size=dp_size))
    meter.hook.load_state_dict(
        {"consumed_tokens": 1000, "consumed_samples": 40, "pending_tokens": 50, "pending_samples": 4}
    )
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    figures = figures_by_step(meter, 1, 1, 1, tokens=10, samples=1)[1]
    assert figures["consumed_tokens"] == 1000 + (50 + 10) * dp_size
    assert figures["consumed_samples"] == 40 + (4 + 1) * dp_size


def test_a_state_saved_without_pending_counts_resumes_with_none_pending():
    """A state of a meter that kept no pending counts (an older checkpoint) continues its consumed counts."""
    meter = throughput_meter(ThroughputConfig(), Runtime())
    meter.hook.load_state_dict({"consumed_tokens": 100, "consumed_samples": 8})
    meter.hook(Event.TRAIN_BEGIN, TrainState(), None)
    figures = figures_by_step(meter, 2, 1, 2, tokens=10, samples=1, step_time=1.0)[2]
    assert (figures["consumed_tokens"], figures["consumed_samples"]) == (120, 10)
    assert figures["tokens_per_s"] == 10.0


def test_mfu_uses_the_peak_of_the_runtimes_own_device(monkeypatch):
    """Each rank asks for the name of its own device (cuda:1 here, an H100 at 989 TFLOP/s)."""
    monkeypatch.setattr(throughput_module, "_device_module", lambda device: FakeDevice())
    meter = started_meter(ThroughputConfig(flops_per_token=989e9), Runtime(device=RANK_DEVICE))
    figures = figures_by_step(meter, 1, 1, 1, tokens=1000, step_time=1.0)[1]
    # about 989 TFLOP/s (the device sync adds its wait to the step time): an MFU of about 1, not 989/312
    assert figures["mfu"] == pytest.approx(figures["tflops"] / 989.0, rel=1e-12)
    assert figures["mfu"] == pytest.approx(1.0, rel=1e-3)


@pytest.mark.parametrize(
    ("name", "warnings"),
    [
        ("NVIDIA H100 80GB HBM3", []),
        ("Some Future Chip",
         ["throughput: no peak FLOP/s known for 'Some Future Chip'; set throughput.peak_tflops for MFU"]),
    ],
)  # fmt: skip
def test_only_an_unlisted_device_warns_naming_it_and_the_flag(monkeypatch, caplog, name, warnings):
    monkeypatch.setattr(throughput_module, "_device_module", lambda device: FakeDevice(name))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        started_meter(ThroughputConfig(), Runtime(device=RANK_DEVICE))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == warnings


def test_an_unreadable_device_name_warns_naming_the_device_and_the_error(monkeypatch, caplog):
    monkeypatch.setattr(throughput_module, "_device_module", lambda device: FakeDevice(None))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        meter = started_meter(ThroughputConfig(flops_per_token=1.0), Runtime(device=RANK_DEVICE))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "throughput: could not read the name of device cuda:1: RuntimeError('driver gone')"
    ]
    assert "mfu" not in figures_by_step(meter, 1, 1, 1)[1]


def test_a_failed_flops_measurement_warns_with_the_error_and_what_is_lost(caplog):
    def broken():
        raise RuntimeError("no meta kernel")

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        started_meter(ThroughputConfig(), flops_per_token=broken)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "throughput: measuring FLOPs per token failed (RuntimeError('no meta kernel')); no TFLOP/s or MFU"
    ]


@pytest.mark.parametrize(
    ("measured", "clock", "line"),
    [
        (123456.0, (100.0, 102.5), "throughput: 1.235e+05 training FLOPs per token (measured in 2.50s)"),
        (6.0, (7.0, 7.125), "throughput: 6 training FLOPs per token (measured in 0.12s)"),
    ],
)
def test_measured_flops_are_logged_with_the_time_the_measure_took(monkeypatch, caplog, measured, clock, line):
    ticks = iter(clock)
    monkeypatch.setattr(throughput_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        started_meter(ThroughputConfig(), flops_per_token=lambda: measured)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [line]


@pytest.mark.parametrize(
    ("device", "module"), [("cpu", None), ("cuda", torch.cuda), ("cuda:1", torch.cuda), ("xpu", torch.xpu)]
)
def test_the_device_synced_and_measured_is_the_runtimes(device, module):
    """The module synchronised and asked for peak memory is that of the runtime's device type, not
    whichever accelerator the host has."""
    assert throughput_module._device_module(torch.device(device)) is module


def test_a_disabled_meter_resumes_from_a_state_an_enabled_one_saved():
    """Turning the meter off for a resumed run: its saved state is accepted and dropped."""
    meter = throughput_meter(ThroughputConfig(enabled=False), Runtime())
    saved = {"throughput": {"consumed_tokens": 100, "consumed_samples": 8}}
    assert load_hook_states([meter.hook], saved) == []
    assert meter.hook.state_dict() == {} and meter.figures() == {}


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"flops_per_token": 0.0}, ValueError, "throughput.flops_per_token must be > 0.0, got 0.0"),
        ({"flops_per_token": -6.0}, ValueError, "throughput.flops_per_token must be > 0.0, got -6.0"),
        ({"peak_tflops": -1.0}, ValueError, "throughput.peak_tflops must be > 0.0, got -1.0"),
        ({"measure_flops": 1}, TypeError, "throughput.measure_flops must be a bool, got 1"),
        ({"memory": "yes"}, TypeError, "throughput.memory must be a bool, got 'yes'"),
    ],
)
def test_config_rejects_a_bad_value_naming_the_field(fields, error, message):
    with pytest.raises(error) as raised:
        throughput_meter(ThroughputConfig(**fields), Runtime())
    assert str(raised.value) == message


@pytest.mark.parametrize("fields", [{"peak_tflops": 0.5}, {"flops_per_token": 0.5}, {"peak_tflops": 1}])
def test_config_accepts_any_positive_rate(fields):
    ThroughputConfig(**fields).validate()
