"""`make_train_step`: one optimizer step over the micro-batches of one global batch [S21]-[S26].

The returned `step_fn(state, batch)` runs forward/backward per micro-batch (gradient sync only on the
last one when data-parallel), weights each micro-batch's loss by its share of the step's valid tokens
(summed over data-parallel ranks), clips, steps the optimizers, zeroes the gradients, steps the
schedulers, and returns its metrics as device tensors: nothing here forces a host sync, except the
checks that are free on CPU and the opt-in skip-non-finite mode.

Data parallelism. DDP and FSDP2 *average* gradients over the data-parallel ranks. In token mode each
rank's micro-batch weights are `tokens_i * dp_size / global_tokens`, so after that average the
gradient is exactly the gradient of one batch holding every rank's tokens, and the per-rank "loss"
metric is (local weighted share x dp_size): its mean over ranks (what the metrics hook reports) is the
exact global token-weighted mean [S23]. The only collective the step adds is the all_reduce of the
step's token count, which the weights need before the first backward.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fntrain.data.device import to_device
from fntrain.data.tokens import count_loss_tokens
from fntrain.state import TrainState
from fntrain.step.losses import default_forward
from fntrain.step.settings import StepSettings, check_settings
from fntrain.step.update import _by_mesh, _make_unscale_and_clip, _make_update, _total_grad_norm

__all__ = ["make_train_step"]

log = logging.getLogger(__name__)


_ASSERT_MODES: dict[str, str] = {}  # device type -> "msg" | "plain" | "host"


def _device_assert(condition: torch.Tensor, message: str, error: type[Exception]) -> None:
    """Assert `condition` on the device without a host sync (`torch._assert_async`).

    A backend without the op (or without its message overload) falls back to the plain op, and as a
    last resort to a host check, which costs a sync per step and is logged once.
    """
    device_type = condition.device.type
    mode = _ASSERT_MODES.get(device_type, "msg")
    if mode == "msg":
        try:
            torch._assert_async(condition, message)
            return
        except NotImplementedError:
            mode = _ASSERT_MODES[device_type] = "plain"
    if mode == "plain":
        try:
            torch._assert_async(condition)
            return
        except NotImplementedError:
            _ASSERT_MODES[device_type] = "host"
            log.warning(
                "torch._assert_async is not available on %s: step checks now cost a host sync", device_type
            )
    if not bool(condition):
        raise error(message)


@contextlib.contextmanager
def _fsdp_accumulation(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2: gradients are reduce-scattered only on the last micro-batch [S21]; sync is switched back
    on when the step ends, even by an exception, so a later single-micro-batch step still syncs."""
    if not enabled:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    schedulers: Any | Sequence[Any] = (),
    *,
    settings: StepSettings = StepSettings(),
    grad_scaler: Any = None,
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] = default_forward,
    step_end: Callable[[], Mapping[str, Any]] | None = None,
) -> Callable[[TrainState, Sequence[Mapping[str, Any]]], dict[str, Any]]:
    """Build `step_fn(state, batch) -> {"loss", "grad_norm", "lr", "loss_tokens"}` for one optimizer step.

    `batch` is the sequence of micro-batches of one global step (a lone mapping is one micro-batch).
    `model` is what `parallelize` returned (plain, DDP or FSDP2); `settings` (`StepSettings`) holds the
    clipping norm, loss weighting, non-finite mode, device, data-parallel size and group, autocast
    dtype and loss context. Token weighting [S23]: the gradient equals that of one big batch over all
    ranks and the reported loss, averaged over data-parallel ranks, is the exact token-weighted mean; a
    step with zero valid tokens must have zero loss (else ValueError) and takes a zero-gradient update.
    "lr" is the rate this step's update used (the schedulers step after it); "loss_tokens" (token mode
    only) is the step's loss-token count over all data-parallel ranks, a device int64 count the metrics
    hook weights its mean by. Order: optimizers step, zero_grad, schedulers step [S25].
    `grad_scaler` (needed for fp16; `ShardedGradScaler` under FSDP2) scales the backward, unscales before
    clipping and skips steps with inf/NaN gradients by itself.
    nonfinite "raise": a non-finite loss (or, when clipping without a scaler, a non-finite gradient norm,
    the same on every rank) is an error naming the step, checked without a host sync on accelerators
    (`torch._assert_async`: it surfaces at the device's next sync; free and immediate on CPU). "skip":
    skip the update and the schedulers instead (metrics gain "skipped"; a host sync per step); with
    several ranks the decision follows the synced gradients' norm, with a scaler it is the scaler's.
    `forward(model, micro_batch)` calls the model. `step_end()`, when given, runs after the schedulers
    on every step, outside autograd (a MoE router's bias update); its metrics (device tensors) are merged
    into the step's (a name the step already reports is a ValueError).
    `loss_fn` may return `(loss, metrics)` (0-d device tensors, e.g. DPO's "rewards/chosen"): combined
    over micro-batches with the loss's weights and merged into the step's metrics.
    """
    check_settings(settings)
    optimizers, schedulers, params = _step_parts(model, optimizers, schedulers)
    device = settings.device if settings.device is not None else params[0].device
    _check_dp_group(settings.dp_size, settings.dp_group)
    on_cpu = device.type == "cpu"
    clip = settings.max_grad_norm > 0
    skip_mode = settings.nonfinite == "skip"
    # Each phase is a closure over its precomputed settings, built once here: the step itself only calls them.
    backward = _make_backward(model, loss_fn, forward, grad_scaler, settings, device)
    unscale_and_clip = _make_unscale_and_clip(params, optimizers, settings.max_grad_norm, grad_scaler)
    should_skip = _make_nonfinite_check(params, on_cpu, skip_mode, clip, grad_scaler, settings.dp_size)
    update = _make_update(optimizers, schedulers, grad_scaler, skip_mode, step_end)

    def step_fn(state: TrainState, batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        micro_batches = [batch] if isinstance(batch, Mapping) else list(batch)
        if not micro_batches:
            raise ValueError(f"step {state.global_step + 1}: the batch holds no micro-batches")
        if not on_cpu:  # data on the host is already where a CPU step needs it: no tree walk per step
            micro_batches = [to_device(mb, device) for mb in micro_batches]
        reported, loss_tokens, objective_metrics = backward(state, micro_batches)
        grad_norm = unscale_and_clip()
        skip = should_skip(state.global_step + 1, reported, grad_norm)
        return _with_objective_metrics(update(reported, grad_norm, skip, loss_tokens), objective_metrics)

    return step_fn


def _with_objective_metrics(metrics: dict[str, Any], objective: Mapping[str, Any] | None) -> dict[str, Any]:
    """The step's metrics with the loss's own merged in (a name the step reports is a ValueError)."""
    if objective is not None:
        if clash := sorted(set(objective) & set(metrics)):
            raise ValueError(f"the loss's metrics {clash} collide with the step's own")
        metrics.update(objective)
    return metrics

def _step_parts(model: torch.nn.Module, optimizers: Any, schedulers: Any) -> tuple[tuple, tuple, list]:
    """(optimizers, schedulers) as tuples and the trainable parameters; none of either is a ValueError."""
    optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    schedulers = tuple(schedulers) if isinstance(schedulers, (list, tuple)) else (schedulers,)
    if not optimizers:
        raise ValueError("make_train_step needs at least one optimizer")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("make_train_step: the model has no trainable parameters")
    return optimizers, schedulers, params


def _check_dp_group(dp_size: int, dp_group: Any) -> None:
    """With dp_size > 1, the process group must exist and the data-parallel group hold dp_size ranks."""
    if dp_size > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"dp_size={dp_size} needs an initialized process group (see setup_runtime)")
        group_size = dist.get_world_size(dp_group)
        if group_size != dp_size:
            raise ValueError(f"dp_size={dp_size} but the data-parallel group has {group_size} ranks")


def _autocast_context(
    device_type: str, autocast_dtype: torch.dtype | None
) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward's autocast context: a no-op context when `autocast_dtype` is None."""
    if autocast_dtype is None:
        return contextlib.nullcontext

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device_type, dtype=autocast_dtype)

    return autocast


def _make_token_weights(
    device: torch.device, dp_size: int, dp_group: Any, ignore_index: int
) -> Callable[[Sequence[Mapping[str, Any]]], tuple[torch.Tensor, torch.Tensor]]:
    """`token_weights(micro_batches) -> (per-micro-batch weights, global token count)` for token mode."""
    reduce_tokens = dp_size > 1

    def token_weights(micro_batches: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = [count_loss_tokens(mb, ignore_index) for mb in micro_batches]
        tokens = torch.stack([torch.as_tensor(c, dtype=torch.int64, device=device) for c in counts])
        total = tokens.sum()
        if reduce_tokens:
            dist.all_reduce(total, group=dp_group)
        # x dp_size undoes DDP/FSDP2's 1/dp gradient averaging: these weights already sum to 1 over all ranks.
        weights = tokens.to(torch.float32) * (dp_size / total.clamp(min=1).to(torch.float32))
        return weights, total

    return token_weights


def _check_zero_tokens(
    state: TrainState, total: torch.Tensor, raw_losses: list[torch.Tensor], on_cpu: bool
) -> None:
    """A step with zero valid tokens must have zero loss (token mode): ValueError naming the step."""
    step = state.global_step + 1
    if on_cpu:
        # On CPU a read is free; testing the count first keeps the common case to one read.
        if int(total) == 0 and any(float(x) != 0 for x in raw_losses):
            raise ValueError(
                f"step {step} has zero loss tokens but a non-zero loss "
                f"({[float(x) for x in raw_losses]}): the loss function must return 0 when no token is valid"
            )
    else:
        bad = (total == 0) & (torch.stack(raw_losses).abs().sum() != 0)
        _device_assert(~bad, f"step {step} has zero loss tokens but a non-zero loss", ValueError)


def _weighted_metrics(
    metrics: list[Mapping[str, torch.Tensor]] | None, weights: torch.Tensor | None, count: int
) -> dict[str, torch.Tensor] | None:
    """An objective's micro-batch metrics combined like its loss: weighted by the micro-batches' token
    shares (token mode: their mean over data-parallel ranks is the global weighted mean) or averaged
    (mean mode); None when the loss returned none. Device ops only, no sync."""
    if metrics is None:
        return None
    if len(metrics) != count:
        raise ValueError("the loss returned metrics for some micro-batches and not for others")
    if count == 1 and weights is None:
        return dict(metrics[0])
    combined = {}
    for name in metrics[0]:
        values = torch.stack([m[name].detach().float() for m in metrics])
        combined[name] = (values * weights).sum() if weights is not None else values.mean()
    return combined


def _make_backward(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any],
    grad_scaler: Any,
    settings: StepSettings,
    device: torch.device,
) -> Callable[[TrainState, list[Mapping[str, Any]]], tuple[torch.Tensor, Any]]:
    """`backward(state, micro_batches) -> (reported loss, loss tokens, objective metrics)`: forward and
    backward of every micro-batch, each loss weighted by its token share (token mode) or 1/count (mean
    mode), gradients synced on the last micro-batch only. The reported loss is the sum of the weighted
    losses, a device tensor; the loss tokens are the step's count over all data-parallel ranks (token
    mode, else None); the metrics those of a loss returning `(loss, metrics)`, combined like the loss
    (`_weighted_metrics`), else None."""
    fsdp = hasattr(model, "set_requires_gradient_sync")
    ddp = not fsdp and hasattr(model, "no_sync")
    on_cpu = device.type == "cpu"
    token_weighted = settings.loss_weighting == "token"
    loss_context = settings.loss_context
    autocast = _autocast_context(device.type, settings.autocast_dtype)
    token_weights = _make_token_weights(device, settings.dp_size, settings.dp_group, settings.ignore_index)

    def backward(state: TrainState, micro_batches: list[Mapping[str, Any]]) -> tuple[torch.Tensor, Any]:
        count = len(micro_batches)
        total_tokens = None
        if token_weighted:
            weights, total_tokens = token_weights(micro_batches)
        parts: list[torch.Tensor] = []
        raw_losses: list[torch.Tensor] = []
        objective_metrics: list[Mapping[str, torch.Tensor]] | None = None  # made only if the loss returns metrics
        with _fsdp_accumulation(model, fsdp and count > 1), loss_context():
            for index, micro_batch in enumerate(micro_batches):
                last = index == count - 1
                if fsdp and last and count > 1:
                    model.set_requires_gradient_sync(True)
                no_sync = model.no_sync() if ddp and not last else contextlib.nullcontext()
                with no_sync:  # DDP: forward and backward of all but the last micro-batch skip the all-reduce
                    with autocast():
                        output = forward(model, micro_batch)
                    loss = loss_fn(output, micro_batch)
                    if type(loss) is tuple:  # an objective's (loss, metrics)
                        loss, metrics = loss
                        objective_metrics = [*(objective_metrics or ()), metrics]
                    if token_weighted:
                        weighted = loss * weights[index]
                    else:
                        weighted = loss / count if count > 1 else loss
                    (grad_scaler.scale(weighted) if grad_scaler is not None else weighted).backward()
                parts.append(weighted.detach())
                if token_weighted:
                    raw_losses.append(loss.detach())
        reported = parts[0] if count == 1 else torch.stack(parts).sum()
        if token_weighted:
            _check_zero_tokens(state, total_tokens, raw_losses, on_cpu)
        extra = _weighted_metrics(objective_metrics, weights if token_weighted else None, count)
        return reported, total_tokens, extra

    return backward

def _make_nonfinite_check(
    params: list[torch.Tensor], on_cpu: bool, skip_mode: bool, clip: bool, grad_scaler: Any, dp_size: int
) -> Callable[[int, torch.Tensor, Any], bool]:
    """`should_skip(step, reported, grad_norm) -> bool`: in "raise" mode a non-finite loss (or clipped
    norm) is a FloatingPointError (on accelerators an async device assert) and the answer is False; in
    "skip" mode, whether to skip this step's update (a documented host sync)."""
    # A scaler expects inf gradients now and then (it skips those steps itself), so only the loss is
    # checked when one is in use; without one, a non-finite clipped norm is a global stop signal.
    check_grad_norm = clip and grad_scaler is None

    def should_skip(step: int, reported: torch.Tensor, grad_norm: Any) -> bool:
        if on_cpu and not skip_mode:
            # On CPU reading a scalar is free (no device to sync), and cheaper than an isfinite op.
            loss_value = float(reported)
            norm_value = float(grad_norm) if check_grad_norm else 0.0
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                raise FloatingPointError(
                    f"non-finite loss at step {step}: loss {loss_value}, grad_norm {float(grad_norm)}"
                )
            return False
        finite = torch.isfinite(reported)
        if check_grad_norm:
            finite = finite & torch.isfinite(grad_norm)
        if not skip_mode:  # and so not on CPU
            _device_assert(finite, f"non-finite loss or gradient norm at step {step}", FloatingPointError)
            return False
        if dp_size == 1:
            return not bool(finite)  # documented host sync
        if grad_scaler is None:
            # The decision must agree on every rank: the synced gradients' norm does, a rank's loss
            # does not (a non-finite loss anywhere makes the synced gradients non-finite everywhere).
            norm = (
                grad_norm
                if clip
                else _total_grad_norm(_by_mesh(params))
            )
            return not bool(torch.isfinite(norm))  # documented host sync
        return False  # the scaler skips non-finite gradients itself, consistently over ranks

    return should_skip
