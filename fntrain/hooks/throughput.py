"""Throughput meter [S28]: step time, tokens/s, samples/s, TFLOP/s per device, MFU, peak memory, consumed counts.

Per step the hook adds the step's host time, samples and tokens to its interval (a few integer and float
additions, no device op: `fntrain.hooks.throughput_interval`). The meter's `figures()` closes the
interval: it synchronises the device, reduces the interval with one collective and returns its figures.
The metrics hook calls it on its logging steps, on every rank (it is one of its sources), after the hook:

- `step_time_s`: time inside the step function (host time, plus the device drain at the logging step),
  averaged over the interval's steps, max over ranks. Data loading and hook time (evaluation,
  checkpoints) are not part of it.
- `tokens_per_s`, `samples_per_s`: the interval's tokens/samples over all data-parallel ranks divided by
  (step time x steps). Tokens come from the loop's `count_batch` (precedence per [S28]).
- `tflops` (TFLOP/s per device) when the training FLOPs per token are known, and `mfu` (fraction of the
  device's peak dense bf16 FLOP/s) when the peak is known too: from `ThroughputConfig.peak_tflops`, else
  from the device table (`fntrain.runtime.peak_flops`). On cpu there is no MFU unless a peak is configured.
- `peak_mem_gib`: the device allocator's peak allocated memory, max over ranks (not on cpu).
- `consumed_tokens`, `consumed_samples`: cumulative over the whole run, kept in the hook's
  `state_dict()` (name "throughput") so a resumed run continues counting.

FLOPs per token are given (`ThroughputConfig.flops_per_token`) or measured once, at TRAIN_BEGIN, by the
callable the run passes (`fntrain.models.flops.measure_flops_per_token` on a meta copy of the model).

The per-step path is one function and a few additions: no combinator layers there, as each costs a call
per event on every step (bench/RESULTS.md, the hooks' per-step row).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fntrain.config import require_bool, require_float
from fntrain.hooks.base import StatefulHook, stateful
from fntrain.hooks.throughput_interval import Interval, add_step, carry_over, local_tokens, reduce_interval
from fntrain.loop import Event
from fntrain.runtime.peak_flops import peak_flops_for_name
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState

__all__ = ["ThroughputConfig", "ThroughputMeter", "throughput_meter"]

log = logging.getLogger("fntrain.hooks.throughput")


@dataclass(frozen=True)
class ThroughputConfig:
    """What the throughput meter reports. Its cadence is the metrics hook's (the recipe's `log_every`)."""

    enabled: bool = True
    """Report throughput on logging steps (off: the hook does nothing and keeps no counts)."""
    flops_per_token: float | None = None
    """Training FLOPs (forward + backward) per token; None: measured on a meta copy (measure_flops)."""
    measure_flops: bool = True
    """Measure FLOPs per token at the start of training when flops_per_token is not given."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU; None: from the device table (no MFU on cpu)."""
    memory: bool = True
    """Report peak allocated device memory (GiB, max over ranks; not on cpu)."""

    def validate(self, prefix: str = "throughput") -> None:
        require_bool(f"{prefix}.enabled", self.enabled)
        if self.flops_per_token is not None:
            require_float(f"{prefix}.flops_per_token", self.flops_per_token, min=0.0, min_exclusive=True)
        require_bool(f"{prefix}.measure_flops", self.measure_flops)
        if self.peak_tflops is not None:
            require_float(f"{prefix}.peak_tflops", self.peak_tflops, min=0.0, min_exclusive=True)
        require_bool(f"{prefix}.memory", self.memory)


def _device_module(device: torch.device) -> Any:
    """torch.cuda / torch.npu / ... for an accelerator, None for cpu (a seam the tests replace)."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device)


def _device_peak_flops(device: torch.device, module: Any) -> float | None:
    """The table's peak FLOP/s for `device` (None on cpu, for an unlisted device, or a failed query)."""
    if module is None:
        return None
    try:
        name = module.get_device_name(device)
    except Exception as error:  # noqa: BLE001 - a missing name only costs the MFU figure
        log.warning("throughput: could not read the name of device %s: %r", device, error)
        return None
    flops = peak_flops_for_name(name)
    if flops is None:
        log.warning("throughput: no peak FLOP/s known for %r; set throughput.peak_tflops for MFU", name)
    return flops


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The throughput hook when disabled: nothing happens."""


@dataclass(frozen=True)
class _Setup:
    """What the meter was built with (never changes)."""

    config: ThroughputConfig
    runtime: Runtime
    flops_per_token: float | Callable[[], float] | None


@dataclass(slots=True)
class _ThroughputMemory:
    """What the meter remembers between events: the interval since the last logging step (this rank),
    the run's consumed counts, and the rates resolved at TRAIN_BEGIN."""

    interval: Interval = field(default_factory=Interval)
    consumed_tokens: int = 0  # all ranks, whole run (identical on every rank)
    consumed_samples: int = 0
    fpt: float | None = None  # training FLOPs per token
    peak: float | None = None  # peak FLOP/s of one device
    module: Any = None  # torch.cuda / torch.npu ..., None on cpu


@dataclass(frozen=True)
class ThroughputMeter:
    """The built meter: `hook` (goes in the hook list, before the metrics hook) counts each step;
    `figures()` closes the interval and returns its figures (on every rank, on the same steps: it syncs
    the device and takes one collective), e.g. as a source of the metrics hook."""

    hook: StatefulHook
    figures: Callable[[], dict[str, float]]


def throughput_meter(
    config: ThroughputConfig,
    runtime: Runtime,
    *,
    flops_per_token: float | Callable[[], float] | None = None,
) -> ThroughputMeter:
    """The throughput meter for `runtime`.

    `flops_per_token` is a number or a callable measured once at TRAIN_BEGIN (e.g. a partial of
    `measure_flops_per_token`); `config.flops_per_token` overrides both, `config.measure_flops=False`
    skips the callable. A failed measurement is a warning (no TFLOP/s, no MFU), never a failed run.
    State (name "throughput"): consumed tokens/samples, plus the counts of steps not yet reduced.
    Disabled: a hook that does nothing and keeps no state, and no figures.
    """
    config.validate()
    if not config.enabled:
        return ThroughputMeter(stateful("throughput", _inactive, dict, lambda saved: None), dict)
    setup = _Setup(config, runtime, flops_per_token)
    memory = _ThroughputMemory()
    interval = memory.interval

    def throughput(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            add_step(interval, info)
        elif event is Event.TRAIN_BEGIN:
            _train_begin(setup, memory)

    hook = stateful(
        "throughput", throughput, lambda: _state_dict(memory), lambda saved: _load_state_dict(memory, saved)
    )
    return ThroughputMeter(hook, lambda: _flush(setup, memory))


def _measured_flops(setup: _Setup) -> float | None:
    """FLOPs per token: configured, given, or measured now by the given callable (a failure, or a
    callable that finds nothing to count on: None)."""
    config, given = setup.config, setup.flops_per_token
    if config.flops_per_token is not None:
        return float(config.flops_per_token)
    if not callable(given):
        return float(given) if given is not None else None
    if not config.measure_flops:
        return None
    started = time.perf_counter()
    try:
        measured = given()
    except Exception as error:  # noqa: BLE001 - TFLOP/s are a nicety, never a failed run
        log.warning("throughput: measuring FLOPs per token failed (%r); no TFLOP/s or MFU", error)
        return None
    if measured is None:  # nothing to count on (a generating objective's batches are prompts)
        log.info("throughput: this run's batches give no FLOPs per token to measure; no TFLOP/s or MFU")
        return None
    measured = float(measured)
    log.info("throughput: %.4g training FLOPs per token (measured in %.2fs)",
             measured, time.perf_counter() - started)  # fmt: skip
    return measured


def _train_begin(setup: _Setup, memory: _ThroughputMemory) -> None:
    """Resolve the rates (FLOPs per token, the device's peak) and start this run's interval."""
    memory.module = _device_module(setup.runtime.device)
    memory.fpt = _measured_flops(setup)
    if setup.config.peak_tflops is not None:
        memory.peak = float(setup.config.peak_tflops) * 1e12
    else:
        memory.peak = _device_peak_flops(setup.runtime.device, memory.module)
    carry_over(memory.interval)  # counts a previous run on this hook left unreduced


def _flush(setup: _Setup, memory: _ThroughputMemory) -> dict[str, float]:
    """Reduce the interval over the ranks (one collective, after a device sync), start a new one, and
    return the interval's figures."""
    with_memory = setup.config.memory and memory.module is not None
    reduced, steps = reduce_interval(memory.interval, memory.module, setup.runtime.device, with_memory)
    figures = _figures(setup, memory, reduced, steps)
    if with_memory:
        figures["peak_mem_gib"] = reduced["peak_mem_gib"]
    return figures


def _figures(setup: _Setup, memory: _ThroughputMemory, reduced: dict[str, Any], steps: int) -> dict[str, Any]:
    """Add the reduced interval to the consumed counts; the interval's figures."""
    scale = setup.runtime.dp_size  # mean over ranks x dp_size = sum over the data-parallel replicas
    interval_tokens = round(reduced["tokens"] * scale)
    interval_samples = round(reduced["samples"] * scale)
    memory.consumed_tokens += interval_tokens + round(reduced["carry_tokens"] * scale)
    memory.consumed_samples += interval_samples + round(reduced["carry_samples"] * scale)
    step_time = reduced["step_time_s"]
    elapsed = step_time * steps
    figures: dict[str, Any] = {
        "step_time_s": step_time,
        "consumed_tokens": memory.consumed_tokens,
        "consumed_samples": memory.consumed_samples,
    }
    if elapsed > 0:
        figures["tokens_per_s"] = interval_tokens / elapsed
        figures["samples_per_s"] = interval_samples / elapsed
        if memory.fpt is not None:
            flops_per_device = memory.fpt * interval_tokens / elapsed / setup.runtime.world_size
            figures["tflops"] = flops_per_device / 1e12
            if memory.peak is not None:
                figures["mfu"] = flops_per_device / memory.peak
    return figures


def _state_dict(memory: _ThroughputMemory) -> dict[str, Any]:
    # The unreduced counts are this rank's; with one state per rank the resume is exact, with rank 0's
    # state on every rank the next logging step scales rank 0's share (exact for equal shares).
    interval = memory.interval
    return {
        "consumed_tokens": memory.consumed_tokens,
        "consumed_samples": memory.consumed_samples,
        "pending_tokens": local_tokens(interval) + interval.carry_tokens,
        "pending_samples": interval.samples + interval.carry_samples,
    }


def _load_state_dict(memory: _ThroughputMemory, saved: Mapping[str, Any]) -> None:
    missing = [key for key in ("consumed_tokens", "consumed_samples") if key not in saved]
    if missing:
        raise ValueError(f"throughput state is missing {missing}, got keys {sorted(saved)}")
    memory.consumed_tokens = int(saved["consumed_tokens"])
    memory.consumed_samples = int(saved["consumed_samples"])
    interval = memory.interval
    interval.carry_tokens = int(saved.get("pending_tokens", 0))
    interval.carry_samples = int(saved.get("pending_samples", 0))
    interval.samples = interval.tokens = 0
    interval.token_tensors.clear()
