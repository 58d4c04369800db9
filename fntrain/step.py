"""`make_train_step`: one optimizer step over the micro-batches of one global batch [S21]-[S26].

The returned `step_fn(state, batch)` runs forward/backward per micro-batch (gradient sync only on the
last one when data-parallel), weights each micro-batch's loss by its share of the step's valid tokens
(summed over data-parallel ranks), clips, steps the optimizers, zeroes the gradients, steps the
schedulers, and returns its metrics as device tensors: nothing here forces a host sync, except the
checks that are free on CPU and the opt-in skip-non-finite mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fntrain.data.tokens import IGNORE_INDEX, count_loss_tokens
from fntrain.state import TrainState

__all__ = ["make_train_step", "default_forward", "causal_lm_loss", "current_lr"]

LOSS_WEIGHTINGS = ("token", "mean")
NONFINITE_MODES = ("raise", "skip")
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def default_forward(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> Any:
    """Call the model with the micro-batch's model inputs as keywords (input_ids, attention_mask, ...)."""
    return model(**{key: micro_batch[key] for key in _MODEL_INPUTS if key in micro_batch})


def causal_lm_loss(output: Any, micro_batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid tokens of one micro-batch; 0 when there are none.

    `output` is the logits tensor or an object with `.logits` (Hugging Face). Targets and validity per [S22].
    """
    from fntrain.data.tokens import loss_targets

    logits = output.logits if hasattr(output, "logits") else output
    targets, valid = loss_targets(micro_batch, ignore_index)
    if "shift_labels" not in micro_batch:
        logits = logits[..., :-1, :]
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        targets.reshape(-1).masked_fill(~valid.reshape(-1), 0),
        reduction="none",
    )
    valid_flat = valid.reshape(-1)
    # Dividing by max(count, 1) keeps an all-ignored micro-batch at exactly 0 (a plain mean gives NaN).
    return (per_token * valid_flat).sum() / valid_flat.sum().clamp(min=1)


def current_lr(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> float:
    """Max of the schedulers' last lr, else max param-group lr [S29] (host floats: no sync)."""
    if schedulers:
        return max(max(s.get_last_lr()) for s in schedulers)
    return max(group["lr"] for opt in optimizers for group in opt.param_groups)


def _to_device(micro_batch: Any, device: torch.device | None) -> Any:
    if device is None or device.type == "cpu":
        return micro_batch
    return optree.tree_map(
        lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, micro_batch
    )


def _gradient_sync(model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """DDP `no_sync` / FSDP2 `set_requires_gradient_sync` for all but the last micro-batch [S21]."""
    if enabled:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def make_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Mapping[str, Any]], torch.Tensor],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    schedulers: Any | Sequence[Any] = (),
    *,
    max_grad_norm: float = 0.0,
    loss_weighting: str = "token",
    forward: Callable[[torch.nn.Module, Mapping[str, Any]], Any] = default_forward,
    device: torch.device | None = None,
    dp_size: int = 1,
    dp_group: Any = None,
    autocast_dtype: torch.dtype | None = None,
    grad_scaler: Any = None,
    nonfinite: str = "raise",
    ignore_index: int = IGNORE_INDEX,
) -> Callable[[TrainState, Sequence[Mapping[str, Any]]], dict[str, Any]]:
    """Build `step_fn(state, batch) -> {"loss", "grad_norm", "lr", ...}` for one optimizer step.

    `batch` is the sequence of micro-batches of one global step (a lone mapping is one micro-batch).
    loss_weighting "token" (default, [S23]): the gradient equals that of one big batch over all ranks and
    the reported loss is the exact token-weighted mean once averaged over data-parallel ranks (the metrics
    hook's reduction); "mean": plain mean over micro-batches and ranks. `max_grad_norm > 0` clips and
    `grad_norm` reports the pre-clip norm, else 0 [S24]. Order: optimizers step, zero_grad, schedulers
    step [S25]. nonfinite "raise": a non-finite loss is an error naming the step, checked without a host
    sync on accelerators (`torch._assert_async`); "skip" skips the update instead, which costs a sync.
    """
    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if not isinstance(max_grad_norm, (int, float)) or isinstance(max_grad_norm, bool) or max_grad_norm < 0:
        raise ValueError(f"max_grad_norm must be a number >= 0, got {max_grad_norm!r}")
    optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
    schedulers = tuple(schedulers) if isinstance(schedulers, (list, tuple)) else (schedulers,)
    if not optimizers:
        raise ValueError("make_train_step needs at least one optimizer")
    params = [p for p in model.parameters() if p.requires_grad]
    device = device if device is not None else (params[0].device if params else torch.device("cpu"))
    on_cpu = device.type == "cpu"
    token_weighted = loss_weighting == "token"
    reduce_tokens = dp_size > 1 and dist.is_available() and dist.is_initialized()
    autocast = (
        (lambda: torch.autocast(device.type, dtype=autocast_dtype))
        if autocast_dtype is not None
        else contextlib.nullcontext
    )
    zero = torch.zeros((), device=device)

    def step_fn(state: TrainState, batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        micro_batches = (batch,) if isinstance(batch, Mapping) else batch
        count = len(micro_batches)
        micro_batches = [_to_device(mb, device) for mb in micro_batches]

        if token_weighted:
            tokens = [count_loss_tokens(mb, ignore_index) for mb in micro_batches]
            total_tokens = torch.stack(tokens).sum() if count > 1 else tokens[0].clone()
            if reduce_tokens:
                dist.all_reduce(total_tokens, group=dp_group)
            # DDP/FSDP2 average gradients over ranks; the token weights already sum to 1 over all ranks,
            # so scaling by dp_size undoes that implicit 1/world.
            denominator = total_tokens.clamp(min=1).to(torch.float32) / dp_size

        loss_sum = zero.clone()
        raw_loss_sum = zero.clone()
        for index, micro_batch in enumerate(micro_batches):
            with _gradient_sync(model, index == count - 1 or count == 1):
                with autocast():
                    output = forward(model, micro_batch)
                loss = loss_fn(output, micro_batch)
                if token_weighted:
                    weighted = loss * tokens[index] / denominator
                    raw_loss_sum += loss.detach()
                else:
                    weighted = loss / count
                (grad_scaler.scale(weighted) if grad_scaler is not None else weighted).backward()
            loss_sum += weighted.detach()

        reported = loss_sum  # token mode: local share x dp_size; averaged over ranks it is the global mean
        if token_weighted:
            no_tokens_but_loss = (total_tokens == 0) & (raw_loss_sum != 0)
            if on_cpu:
                if bool(no_tokens_but_loss):
                    raise ValueError(
                        f"step {state.global_step + 1} has zero loss tokens but a non-zero loss "
                        f"({float(raw_loss_sum)}): the loss function must return 0 when no token is valid"
                    )
            else:
                torch._assert_async(~no_tokens_but_loss, f"step {state.global_step + 1}: zero loss tokens but non-zero loss")

        finite = torch.isfinite(reported)
        skip = False
        if nonfinite == "skip":
            skip = not bool(finite)  # documented host sync
        elif on_cpu:
            if not bool(finite):
                raise FloatingPointError(f"non-finite loss at step {state.global_step + 1}: {float(reported)}")
        else:
            torch._assert_async(finite, f"non-finite loss at step {state.global_step + 1}")

        if grad_scaler is not None:
            for optimizer in optimizers:
                grad_scaler.unscale_(optimizer)
        if max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=None)
            if hasattr(grad_norm, "full_tensor"):  # DTensor under FSDP2
                grad_norm = grad_norm.full_tensor()
        else:
            grad_norm = zero

        if not skip:
            for optimizer in optimizers:
                if grad_scaler is not None:
                    grad_scaler.step(optimizer)
                else:
                    optimizer.step()
            if grad_scaler is not None:
                grad_scaler.update()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if not skip:
            for scheduler in schedulers:
                scheduler.step()
        metrics = {"loss": reported, "grad_norm": grad_norm, "lr": current_lr(optimizers, schedulers)}
        if nonfinite == "skip":
            metrics["skipped"] = float(skip)
        return metrics

    return step_fn
