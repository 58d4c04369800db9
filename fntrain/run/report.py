"""What a run prints at its start (rank 0): the model's size, where it runs, and the resolved plan.

`describe_start(built)` takes what the job built (duck-typed: `config`, `runtime`, `plan`, and the model
as `model` or `components.model`) and returns a few lines:

    model: 1,234,567 parameters (1.23M), 1,234,567 trainable
    world: 1 process, device cpu, parallel none
    plan: 400 steps over 8 epochs of up to 50 steps; global batch 32 = micro 16 x accum 2 x dp 1
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe_start", "count_parameters", "human_count"]


def count_parameters(model: Any) -> tuple[int, int]:
    """(total, trainable) parameter counts of `model`; a parameter shared by two modules counts once,
    and a sharded parameter (FSDP2's DTensor) counts with its global size."""
    total = trainable = 0
    seen: set[int] = set()
    for parameter in model.parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        count = parameter.numel()
        total += count
        if parameter.requires_grad:
            trainable += count
    return total, trainable


def human_count(count: int) -> str:
    """`1234567` -> `1.23M`; below a thousand the number itself."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def describe_start(built: Any) -> list[str]:
    """The start-of-run lines: parameter count (total / trainable), world size and device, and the plan
    (train_iters, epochs x steps/epoch, global batch = micro x accum x dp)."""
    lines = []
    model = getattr(built, "model", None)
    if model is None:
        model = getattr(getattr(built, "components", None), "model", None)
    if model is not None and hasattr(model, "parameters"):
        total, trainable = count_parameters(model)
        stages = int(getattr(built.runtime, "pp_size", 1))
        stage = f" in pipeline stage {built.runtime.pp_rank} of {stages}" if stages > 1 else ""
        lines.append(f"model: {total:,} parameters ({human_count(total)}){stage}, {trainable:,} trainable")
    runtime, config, plan = built.runtime, built.config, built.plan
    world = int(getattr(runtime, "world_size", 1))
    parallel = getattr(config, "parallel", None)
    where = f"world: {world} process{'es' if world != 1 else ''}, device {getattr(runtime, 'device', '?')}"
    if parallel is not None:
        where += f", parallel {parallel.strategy}"
        where += f", tp {parallel.tp_size}" if parallel.tp_size > 1 else ""
        where += f", pp {parallel.pp_size} ({parallel.pp_schedule})" if parallel.pp_size > 1 else ""
        where += f", cp {parallel.cp_size} ({parallel.cp_style})" if parallel.cp_size > 1 else ""
    lines.append(where)
    epochs = f"{plan.epochs} epoch{'s' if plan.epochs != 1 else ''} of up to {plan.steps_per_epoch} steps"
    if not getattr(plan, "sized", True):
        epochs = "a stream of unknown length"
    lines.append(
        f"plan: {plan.train_iters} steps over {epochs}; global batch {plan.global_batch_size} = "
        f"micro {plan.micro_batch_size} x accum {plan.micro_batches} x dp {plan.dp_size}"
    )
    return lines
