"""Throughput meter [S28]: step time, tokens/s, samples/s, TFLOP/s per device, MFU, peak memory, consumed counts.

Per step the hook adds the step's host time, samples and tokens to its interval (a few integer and float
additions; a token count that is a device tensor is kept by reference, not summed). The meter's
`figures()` closes the interval: it synchronises the device (the wait is added to the step time, so
queued device work is counted), reduces the interval with one collective and returns its figures. The
metrics hook calls it on its logging steps, on every rank (it is one of its sources), after the hook:

- `step_time_s`: time inside the step function (host time, plus the device drain at the logging step),
  averaged over the interval's steps, max over ranks. Data loading and hook time (evaluation,
  checkpoints) are not part of it.
- `tokens_per_s`, `samples_per_s`: the interval's tokens/samples over all data-parallel ranks divided by
  (step time x steps). Tokens come from the loop's `count_batch` (precedence per [S28]).
- `tflops` (TFLOP/s per device) when the training FLOPs per token are known, and `mfu` (fraction of the
  device's peak dense bf16 FLOP/s) when the peak is known too: from `ThroughputConfig.peak_tflops`, else
  from `PEAK_FLOPS` by device name. On cpu there is no MFU unless a peak is configured.
- `peak_mem_gib`: the device allocator's peak allocated memory, max over ranks (not on cpu).
- `consumed_tokens`, `consumed_samples`: cumulative over the whole run, kept in the hook's
  `state_dict()` (name "throughput") so a resumed run continues counting.

FLOPs per token are given analytically (`ThroughputConfig.flops_per_token`,
`dense_transformer_flops_per_token`) or measured once, at TRAIN_BEGIN, with
`torch.utils.flop_counter.FlopCounterMode` on a meta-device copy of the model (`measure_flops_per_token`):
no memory is allocated and nothing runs on the device.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from fntrain.config import require_bool, require_float
from fntrain.data.tokens import count_tokens
from fntrain.hooks.base import StatefulHook, stateful
from fntrain.loop import Event
from fntrain.runtime.collectives import exact_dtype, reduce_scalars
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from fntrain.step import default_forward

__all__ = [
    "ThroughputConfig",
    "ThroughputMeter",
    "throughput_meter",
    "PEAK_FLOPS",
    "peak_flops_for_name",
    "device_peak_flops",
    "measure_flops_per_token",
    "dense_transformer_flops_per_token",
]

log = logging.getLogger("fntrain.hooks.throughput")

_GIB = float(2**30)
_FOLD_AT = 256  # token tensors kept before they are summed into one (bounds memory when nothing logs)

# Peak dense (no sparsity) bf16 matrix FLOP/s of one device, matched as a case-insensitive substring of
# the device name, first match wins (so "H200" is tested before "H20", "L40S" before "L40"). Sources:
# vendor datasheets (NVIDIA, AMD); Ascend values as used by VeOmni/verl (one device = one die).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800 PCIe", 756e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L20", 119.5e12),
    ("L4", 121e12),
    ("A40", 149.7e12),
    ("A10", 125e12),
    ("RTX 6000 Ada", 364.2e12),
    ("RTX 5090", 209.5e12),
    ("RTX 4090", 165.2e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16: no bf16 on Volta
    ("T4", 65e12),  # fp16
    ("MI355X", 2500e12),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
    ("MI250", 362e12),
    ("910B", 354e12),  # Ascend 910B1..B4 ("Ascend910B2", "Ascend910B3", ...)
    ("910_93", 354e12),  # Ascend 910C, reported per die as "Ascend910_93xx"
    ("910C", 354e12),
)


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


# ----------------------------------------------------------------------------- peak FLOP/s


def peak_flops_for_name(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name from `PEAK_FLOPS`, or None when it is not listed."""
    lowered = device_name.lower()
    for pattern, flops in PEAK_FLOPS:
        if pattern.lower() in lowered:
            return flops
    return None


def _device_module(device: torch.device) -> Any:
    """torch.cuda / torch.npu / ... for an accelerator, None for cpu (a seam the tests replace)."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device)


def device_peak_flops(device: torch.device) -> float | None:
    """The table's peak FLOP/s for `device` (None on cpu, for an unlisted device, or a failed query)."""
    module = _device_module(device)
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


# ----------------------------------------------------------------------------- FLOPs per token


def dense_transformer_flops_per_token(n_params: int, n_layers: int, d_model: int, context: int) -> float:
    """Training FLOPs per token of a dense decoder: 6 N + 12 L d T (PaLM, appendix B).

    6 N covers the forward and backward matmuls of the N parameters, 12 L d T the attention scores and
    values over a context of T tokens (not halved for the causal mask).
    """
    return 6.0 * n_params + 12.0 * n_layers * d_model * context


def _meta_copy(model: Any) -> torch.nn.Module:
    """A copy of `model` on the meta device, allocating no memory: a module's parameters and buffers are
    replaced through deepcopy's memo (ties kept); a zero-argument factory is called under the meta device."""
    if not isinstance(model, torch.nn.Module):
        with torch.device("meta"):
            return model()
    memo: dict[int, Any] = {}
    for param in model.parameters():
        if id(param) not in memo:
            memo[id(param)] = torch.nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    for buffer in model.buffers():
        memo.setdefault(id(buffer), torch.empty_like(buffer, device="meta"))
    return copy.deepcopy(model, memo)


def measure_flops_per_token(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    example_batch: Mapping[str, Any],
    *,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None,
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] | None = None,
    backward: bool = True,
) -> float:
    """Training FLOPs per token, counted by FlopCounterMode over one forward (and backward) on meta.

    `model` is an unwrapped module (copied to meta through deepcopy's memo) or a factory called under
    the meta device. `example_batch` is one micro-batch of host tensors; its tokens are counted like the
    loop counts them (`count_tokens`), so FLOPs per step = this x the step's tokens for batches of that
    shape. Backward uses `loss_fn(output, batch)`, else the output's sum. A padded batch's 2-D
    `attention_mask` is left out of the meta forward: the kernels compute the padded positions all the
    same (the count depends on shapes only), and a model that inspects its mask (transformers asks
    whether it is all ones) cannot read a meta tensor.
    """
    from torch.utils.flop_counter import FlopCounterMode

    tokens = int(count_tokens(example_batch))
    if tokens <= 0:
        raise ValueError(f"the example batch must hold at least one token, got {tokens}")
    meta_model = _meta_copy(model)
    shapes_only = dict(example_batch)
    mask = shapes_only.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        del shapes_only["attention_mask"]
    meta_batch = optree.tree_map(
        lambda leaf: leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf, shapes_only
    )
    forward = forward or default_forward
    with FlopCounterMode(display=False) as counter:
        output = forward(meta_model, meta_batch)
        if backward:
            if loss_fn is not None:
                loss = loss_fn(output, meta_batch)
            else:
                loss = (output.logits if hasattr(output, "logits") else output).sum()
            if loss.requires_grad:
                loss.backward()
    return counter.get_total_flops() / tokens


# ----------------------------------------------------------------------------- the hook


def _inactive(event: Event, state: TrainState, info: Any) -> None:
    """The throughput hook when disabled: nothing happens."""


@dataclass(frozen=True)
class _Setup:
    """What the meter was built with (never changes)."""

    config: ThroughputConfig
    device: torch.device
    flops_per_token: float | Callable[[], float] | None
    scale: int  # mean over ranks x dp_size = sum over the data-parallel replicas
    world: int
    reduce_dtype: torch.dtype


@dataclass(slots=True)
class _ThroughputMemory:
    """What the meter remembers between events."""

    busy: float = 0.0  # host seconds inside steps since the last logging step (this rank)
    steps: int = 0
    samples: int = 0
    tokens: int = 0  # integer token counts since the last logging step
    token_tensors: list[Any] = field(default_factory=list)  # tensor token counts, summed when reduced
    carry_tokens: int = 0  # restored counts of steps a checkpoint had not yet reduced
    carry_samples: int = 0
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


def _no_figures() -> dict[str, float]:
    return {}


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
        return ThroughputMeter(stateful("throughput", _inactive, dict, lambda saved: None), _no_figures)
    setup = _Setup(
        config, runtime.device, flops_per_token,
        scale=runtime.dp_size, world=runtime.world_size, reduce_dtype=exact_dtype(runtime.device),
    )  # fmt: skip
    memory = _ThroughputMemory()

    def throughput(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.STEP_END:
            _count(memory, info)
        elif event is Event.TRAIN_BEGIN:
            _train_begin(setup, memory)

    hook = stateful(
        "throughput", throughput, lambda: _state_dict(memory), lambda saved: _load_state_dict(memory, saved)
    )
    return ThroughputMeter(hook, lambda: _flush(setup, memory))


def _count(memory: _ThroughputMemory, info: Any) -> None:
    """Add one step to the interval (no device op: a tensor token count is kept by reference)."""
    memory.busy += info.step_time_s
    memory.steps += 1
    memory.samples += info.samples
    count, token_tensors = info.tokens, memory.token_tensors
    if count.__class__ is int:
        memory.tokens += count
    elif isinstance(count, torch.Tensor):
        token_tensors.append(count)
        if len(token_tensors) >= _FOLD_AT:  # a device op, no sync: only when nothing logs for long
            folded = torch.stack(token_tensors).sum()
            token_tensors.clear()
            token_tensors.append(folded)
    else:
        memory.tokens += int(count)


def _resolve(setup: _Setup, memory: _ThroughputMemory) -> None:
    """FLOPs per token (measured now when it is a callable) and the device's peak FLOP/s."""
    config, flops_per_token = setup.config, setup.flops_per_token
    memory.module = _device_module(setup.device)
    if config.flops_per_token is not None:
        memory.fpt = float(config.flops_per_token)
    elif callable(flops_per_token):
        memory.fpt = None
        if config.measure_flops:
            started = time.perf_counter()
            try:
                memory.fpt = float(flops_per_token())
            except Exception as error:  # noqa: BLE001 - TFLOP/s are a nicety, never a failed run
                log.warning("throughput: measuring FLOPs per token failed (%r); no TFLOP/s or MFU", error)
            else:
                log.info(
                    "throughput: %.4g training FLOPs per token (measured in %.2fs)",
                    memory.fpt, time.perf_counter() - started,
                )  # fmt: skip
    else:
        memory.fpt = float(flops_per_token) if flops_per_token is not None else None
    if config.peak_tflops is not None:
        memory.peak = float(config.peak_tflops) * 1e12
    else:
        memory.peak = device_peak_flops(setup.device)


def _local_tokens(memory: _ThroughputMemory) -> int:
    """This rank's tokens since the last logging step (reads the device: logging steps only)."""
    if memory.token_tensors:
        return memory.tokens + int(torch.stack(memory.token_tensors).sum())
    return memory.tokens


def _reset_interval(memory: _ThroughputMemory) -> None:
    memory.busy, memory.steps, memory.samples, memory.tokens = 0.0, 0, 0, 0
    memory.token_tensors.clear()


def _flush(setup: _Setup, memory: _ThroughputMemory) -> dict[str, float]:
    """Reduce the interval over the ranks (one collective, after a device sync), start a new one, and
    return the interval's figures."""
    module, device = memory.module, setup.device
    if module is not None:
        started = time.perf_counter()
        module.synchronize()  # the steps' queued device work belongs to their time
        memory.busy += time.perf_counter() - started
    steps = memory.steps
    values: dict[str, Any] = {
        "tokens": _local_tokens(memory),
        "samples": memory.samples,
        "carry_tokens": memory.carry_tokens,
        "carry_samples": memory.carry_samples,
        "step_time_s": memory.busy / steps if steps else 0.0,
    }
    ops = {"step_time_s": "max"}
    with_memory = setup.config.memory and module is not None
    if with_memory:
        values["peak_mem_gib"] = module.max_memory_allocated(device) / _GIB
        ops["peak_mem_gib"] = "max"
    reduced = reduce_scalars(values, ops, device=device, dtype=setup.reduce_dtype)
    figures = _figures(setup, memory, reduced, steps)
    if with_memory:
        figures["peak_mem_gib"] = reduced["peak_mem_gib"]
    _reset_interval(memory)
    memory.carry_tokens = memory.carry_samples = 0
    return figures


def _figures(setup: _Setup, memory: _ThroughputMemory, reduced: dict[str, Any], steps: int) -> dict[str, Any]:
    """Add the reduced interval to the consumed counts; the interval's figures."""
    scale = setup.scale
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
            flops_per_device = memory.fpt * interval_tokens / elapsed / setup.world
            figures["tflops"] = flops_per_device / 1e12
            if memory.peak is not None:
                figures["mfu"] = flops_per_device / memory.peak
    return figures


def _train_begin(setup: _Setup, memory: _ThroughputMemory) -> None:
    _resolve(setup, memory)
    # Counts a previous run on this hook left unreduced are consumed, but not this run's rate.
    memory.carry_tokens += _local_tokens(memory)
    memory.carry_samples += memory.samples
    _reset_interval(memory)


def _state_dict(memory: _ThroughputMemory) -> dict[str, Any]:
    # The unreduced counts are this rank's; with one state per rank the resume is exact, with rank 0's
    # state on every rank the next logging step scales rank 0's share (exact for equal shares).
    return {
        "consumed_tokens": memory.consumed_tokens,
        "consumed_samples": memory.consumed_samples,
        "pending_tokens": _local_tokens(memory) + memory.carry_tokens,
        "pending_samples": memory.samples + memory.carry_samples,
    }


def _load_state_dict(memory: _ThroughputMemory, saved: Mapping[str, Any]) -> None:
    missing = [key for key in ("consumed_tokens", "consumed_samples") if key not in saved]
    if missing:
        raise ValueError(f"throughput state is missing {missing}, got keys {sorted(saved)}")
    memory.consumed_tokens = int(saved["consumed_tokens"])
    memory.consumed_samples = int(saved["consumed_samples"])
    memory.carry_tokens = int(saved.get("pending_tokens", 0))
    memory.carry_samples = int(saved.get("pending_samples", 0))
    memory.samples = memory.tokens = 0
    memory.token_tensors.clear()
