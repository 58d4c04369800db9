"""The resolved run plan as plain data: what `fntrain plan` prints, computed without a model or a device.

`describe_run_plan(plan, inputs)` takes a `RunPlan` and a `PlanInputs` (the world, the parallel config
and the hook configs a recipe carries: profiler, memory, checkpoint; any may be absent) and returns a
JSON-ready dict: run length, batch shape, the device mesh (dims, a few ranks' coordinates and groups,
the pipeline-stage leaders), the steps a fresh run checkpoints at and the disk its checkpoints take
(with `PlanInputs.checkpoint_bytes`: per checkpoint and at most at once), the profiler and memory windows in
steps of this run, and which ranks record. A "memory_per_rank" entry of `extra`
(`fntrain.plan.memory.plan_memory`) is rendered too. `fntrain.plan.render.format_run_plan(report)`
renders it for a terminal. Nothing here imports torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from fntrain.mesh_layout import group_ranks, mesh_dims, rank_coordinates, stage_leaders
from fntrain.state import RunPlan

__all__ = ["PlanInputs", "describe_run_plan", "checkpoint_steps"]

_MESH_RANKS_ALL = 16  # larger worlds show the first and last _MESH_RANKS_EDGE ranks
_MESH_RANKS_EDGE = 4


@dataclass(frozen=True)
class PlanInputs:
    """What a plan describes besides its `RunPlan`: the world it runs on and the configs whose
    sections it shows (None: the section is left out)."""

    world_size: int = 1
    pp_size: int = 1
    parallel: Any = None
    """The `ParallelConfig`: the device mesh section."""
    device_type: str = "cpu"
    dataset_len: int | None = None
    profiler: Any = None
    """The profiler hook's config: its window and ranks."""
    memory: Any = None
    """The memory hook's config: its window, recording and writing ranks."""
    checkpoint: Any = None
    """The checkpoint config (its `dir` already resolved): the steps a fresh run saves at."""
    restoring: bool = False
    """The run restores a checkpoint (checkpoint.restore_from): it also saves its final step."""
    checkpoint_bytes: Mapping[str, Any] | None = None
    """One checkpoint's size (`fntrain.plan.checkpoint_disk.checkpoint_bytes`; None: unknown)."""
    evaluates: bool = False
    """Evaluation runs: keep_best keeps the best checkpoint by val_loss beside the newest."""


def checkpoint_steps(
    plan: RunPlan, *, save_every: int = 0, save_epochs: int = 0, save_at_end: bool = True
) -> list[int]:
    """Global steps at which a fresh run saves [S36]: every `save_every` steps, at the end of every
    `save_epochs`-th epoch, and once at the end when the last step is otherwise unsaved."""
    steps: set[int] = set()
    if save_every and save_every > 0:
        steps.update(range(save_every, plan.train_iters + 1, save_every))
    if save_epochs and save_epochs > 0 and plan.sized:
        for epoch in range(plan.epochs):
            if (epoch + 1) % save_epochs == 0:
                steps.add(min((epoch + 1) * plan.steps_per_epoch, plan.train_iters))
    if save_at_end and (steps or save_every or save_epochs):
        steps.add(plan.train_iters)
    return sorted(steps)


def _profiler_section(
    config: Any, *, world_size: int, pp_size: int, device_type: str, train_iters: int
) -> dict:
    # Imported here, not above: `fntrain plan` and `import fntrain.plan.report` stay free of torch.
    from fntrain.hooks.profiler import check_profiler_config, profiled_ranks
    from fntrain.runtime.runtime import Runtime

    # The profiler's own checks and normalisation, on a stand-in device: planning touches none.
    runtime = Runtime(world_size=world_size, pp_size=pp_size, device=SimpleNamespace(type=device_type))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = check_profiler_config(config, runtime)
    section: dict[str, Any] = {"enabled": bool(config.enabled)}
    notes = [str(w.message) for w in caught]
    if notes:
        section["notes"] = notes
    if not config.enabled:
        return section
    start = 1 if config.start_on_init else config.start_step
    stop = config.stop_step
    section.update(
        start_step=config.start_step,
        stop_step=stop,
        starts_at="TRAIN_BEGIN" if config.start_on_init else f"step {start}",
        steps=[start, min(stop, train_iters)] if start <= train_iters else [],
        partial=stop > train_iters and start <= train_iters,
        ranks=sorted(profiled_ranks(config, world_size, pp_size)),
        output=f"{config.output_path or './output'}/profile/rank_<rank>/",
    )
    if start > train_iters:
        section["notes"] = [
            *section.get("notes", []),
            f"the window starts after the last step ({train_iters})",
        ]
    return section


def _mesh_section(parallel: Any, world_size: int) -> dict:
    """The runtime mesh's dims, the coordinates and groups of every rank (head and tail ranks of a
    large world) and the first rank of each pipeline stage, from `fntrain.mesh_layout`."""
    dims = mesh_dims(
        world_size,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        cp_size=getattr(parallel, "cp_size", 1),
        replicate=getattr(parallel, "replicate", 1),
        ep_size=getattr(parallel, "ep_size", 1),
    )
    group_dims = [name for name, _ in dims if not name.startswith("dp")]
    group_dims.insert(1 if dims[0][0] == "pp" else 0, "dp")
    if getattr(parallel, "replicate", 1) > 1:
        group_dims.insert(group_dims.index("dp") + 1, "dp_shard")  # FSDP2 shards over it
    if getattr(parallel, "ep_size", 1) > 1:
        group_dims.insert(group_dims.index("dp") + 1, "dp_mod_ep")  # FSDP2 shards the experts over it
    if world_size <= _MESH_RANKS_ALL:
        shown = list(range(world_size))
    else:
        shown = [*range(_MESH_RANKS_EDGE), *range(world_size - _MESH_RANKS_EDGE, world_size)]
    ranks = [
        {
            "rank": rank,
            "coordinates": rank_coordinates(rank, dims),
            "groups": {name: group_ranks(rank, dims, name) for name in group_dims},
        }
        for rank in shown
    ]
    return {
        "dims": [[name, size] for name, size in dims],
        "ranks": ranks,
        "all_ranks_shown": len(shown) == world_size,
        "stage_leaders": stage_leaders(world_size, parallel.pp_size),
    }


def _memory_section(config: Any, *, world_size: int, train_iters: int, device_type: str) -> dict:
    config.validate("memory")
    section: dict[str, Any] = {"enabled": bool(config.enable), "mem_info": bool(config.mem_info)}
    if config.mem_info:
        section["mem_info_ranks"] = list(range(world_size))
    if not config.enable:
        return section
    start, end = config.start_step, config.end_step
    first = max(start, 1)
    last = min(end - 1, train_iters)
    writers = sorted({r for r in config.dump_ranks if r < world_size})
    section.update(
        start_step=start,
        end_step=end,
        starts_at="TRAIN_BEGIN" if start == 0 else f"before step {start}",
        writes_at=(f"before step {end}" if end <= train_iters else "at TRAIN_END (partial window)"),
        recorded_steps=[first, last] if first <= last else [],
        recording_ranks=list(range(world_size)),
        writing_ranks=writers,
        save_path=config.save_path,
    )
    notes = []
    if device_type == "cpu":
        notes.append(
            "memory.enable needs a cuda or npu device (allocator history); on cpu the run fails at setup"
        )
    if start > train_iters:
        notes.append(f"the window starts after the last step ({train_iters}): nothing is recorded")
    elif not writers:
        notes.append(
            f"memory.dump_ranks {list(config.dump_ranks)} names no rank of this {world_size}-rank run"
        )
    if notes:
        section["notes"] = notes
    return section


def _checkpoint_section(config: Any, plan: RunPlan, restoring: bool) -> dict:
    save_every = int(getattr(config, "save_every", 0) or 0)
    save_epochs = int(getattr(config, "save_epochs", 0) or 0)
    save_at_end = bool(getattr(config, "save_at_end", getattr(config, "save_last", True)))
    # a run resumed from a checkpoint saves its final step even without a cadence (the checkpoint
    # hook's `saves_at_end`)
    ends_saved = save_at_end and (bool(getattr(config, "enabled", False)) or restoring)
    enabled = bool(getattr(config, "enabled", getattr(config, "enable", True))) or ends_saved
    minutes = float(getattr(config, "save_every_minutes", 0) or 0)
    steps = checkpoint_steps(plan, save_every=save_every, save_epochs=save_epochs, save_at_end=save_at_end)
    if minutes > 0 and save_at_end and plan.train_iters not in steps:
        steps.append(plan.train_iters)  # time-based saves also end with a final one
    if ends_saved and plan.train_iters not in steps:
        steps.append(plan.train_iters)  # a resumed run ends with a checkpoint of its final step
    section: dict[str, Any] = {
        "enabled": enabled and bool(steps or minutes > 0),
        "steps": steps if enabled else [],
    }
    for name in (
        "save_every",
        "save_every_minutes",
        "time_based_temporary",
        "save_epochs",
        "keep_last",
        "keep_best",
        "async_save",
        "restore_from",
        "save_on_interrupt",
        "dir",
    ):
        if hasattr(config, name):
            section[name] = getattr(config, name)
    return section


def _disk(section: Mapping[str, Any], size: Mapping[str, Any], best: bool) -> dict[str, Any]:
    """The checkpoints' disk: one checkpoint's bytes (`size`), how many exist at once at most (None:
    unbounded, time-based saves without keep_last) and their bytes."""
    from fntrain.plan.checkpoint_disk import checkpoints_at_once

    keep_last = int(section.get("keep_last") or 0)
    at_once = checkpoints_at_once(len(section["steps"]), keep_last, best and keep_last > 0,
                                  timed=bool(section.get("save_every_minutes")))  # fmt: skip
    disk = {**size, "at_once": at_once, "kept_best": best and keep_last > 0}
    if at_once is not None:
        disk["at_once_bytes"] = at_once * size["total"]
    return disk


def describe_run_plan(
    plan: RunPlan, inputs: PlanInputs = PlanInputs(), extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The plan of a fresh run as JSON-ready data (see the module doc). Config errors raise as the
    hooks themselves would, naming the dotted field."""
    world_size, device_type = inputs.world_size, inputs.device_type
    report: dict[str, Any] = {
        "world_size": world_size,
        "dp_size": plan.dp_size,
        "train_iters": plan.train_iters,
        "steps_per_epoch": plan.steps_per_epoch,
        "epochs": plan.epochs,
        "micro_batches": plan.micro_batches,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "lr_schedule_iters": plan.lr_schedule_iters,
        "dataset_len": inputs.dataset_len,
        "sized": plan.sized,
    }
    if extra:
        report.update(extra)
    if inputs.parallel is not None:
        report["mesh"] = _mesh_section(inputs.parallel, world_size)
    if inputs.checkpoint is not None:
        section = _checkpoint_section(inputs.checkpoint, plan, inputs.restoring)
        if inputs.checkpoint_bytes is not None and section["enabled"]:
            keeps_best = bool(getattr(inputs.checkpoint, "keep_best", False)) and inputs.evaluates
            section["disk"] = _disk(section, inputs.checkpoint_bytes, keeps_best)
        report["checkpoint"] = section
    if inputs.profiler is not None:
        report["profiler"] = _profiler_section(
            inputs.profiler,
            world_size=world_size,
            pp_size=inputs.pp_size,
            device_type=device_type,
            train_iters=plan.train_iters,
        )
    if inputs.memory is not None:
        report["memory"] = _memory_section(
            inputs.memory, world_size=world_size, train_iters=plan.train_iters, device_type=device_type
        )
    return report
