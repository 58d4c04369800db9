"""`format_run_plan(report)`: the plan `fntrain.plan.report.describe_run_plan` returns, as the aligned
text `fntrain plan` prints (label column, two spaces, value). Long step lists show head ... tail, large
worlds a few ranks of the mesh. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fntrain.plan.estimate import format_bytes

__all__ = ["format_run_plan"]

_LIST_LIMIT = 12  # longer step lists are shown as head ... tail
# The report's keys the head rows render themselves; any other plain value gets a row of its own.
_SHOWN = frozenset({
    "recipe", "world_size", "dp_size", "dataset_len", "train_iters", "steps_per_epoch", "epochs",
    "micro_batches", "global_batch_size", "micro_batch_size", "lr_schedule_iters", "sized",
    "memory_per_rank", "data_read", "notes",
})  # fmt: skip

Rows = list[tuple[str, str]]


def format_run_plan(report: Mapping[str, Any]) -> str:
    """`report` (from `describe_run_plan`) as aligned text lines."""
    world = report["world_size"]
    rows = _head_rows(report)
    if report.get("mesh") is not None:
        rows.extend(_mesh_rows(report["mesh"]))
    if report.get("memory_per_rank") is not None:
        rows.extend(_memory_per_rank_rows(report["memory_per_rank"]))
    if report.get("checkpoint") is not None:
        rows.extend(_checkpoint_rows(report["checkpoint"]))
    if report.get("profiler") is not None:
        rows.extend(_profiler_rows(report["profiler"], world))
    if report.get("memory") is not None:
        rows.extend(_memory_rows(report["memory"], world))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _head_rows(report: Mapping[str, Any]) -> Rows:
    """Run length and batch shape, then the report's other plain values and its notes."""
    rows: Rows = []
    if "recipe" in report:
        rows.append(("recipe", str(report["recipe"])))
    world, dp = report["world_size"], report["dp_size"]
    rows.append(("world size", f"{world} (data-parallel {dp})"))
    if report.get("dataset_len") is not None:
        rows.append(("dataset", f"{report['dataset_len']} samples"))
    rows.append(("train_iters", str(report["train_iters"])))
    unsized = " (streaming)" if report.get("data_read", True) else " (data not read)"
    per_epoch = str(report["steps_per_epoch"]) + ("" if report.get("sized", True) else unsized)
    rows.append(("steps per epoch", per_epoch))
    rows.append(("epochs", str(report["epochs"])))
    rows.append(
        (
            "micro-batches/step",
            f"{report['micro_batches']} (global batch {report['global_batch_size']} = micro-batch "
            f"{report['micro_batch_size']} x {report['micro_batches']} x data-parallel {dp})",
        )
    )
    rows.append(("lr schedule iters", str(report["lr_schedule_iters"])))
    for key, value in report.items():
        if key in _SHOWN or isinstance(value, Mapping):
            continue
        rows.append((key.replace("_", " "), str(value)))
    rows.extend(("note", note) for note in report.get("notes", ()))
    return rows


def _steps(steps: Sequence[int]) -> str:
    if len(steps) <= _LIST_LIMIT:
        return ", ".join(map(str, steps))
    head, tail = steps[:5], steps[-3:]
    return f"{', '.join(map(str, head))}, ..., {', '.join(map(str, tail))}"


def _ranks(ranks: Sequence[int], world_size: int) -> str:
    if list(ranks) == list(range(world_size)):
        return f"every rank ({world_size})" if world_size > 1 else "rank 0"
    return "ranks " + _steps(ranks) if len(ranks) != 1 else f"rank {ranks[0]}"


def _coordinates(coordinates: Mapping[str, int]) -> str:
    text = []
    for name, value in coordinates.items():
        if name == "dp_replicate":
            text.append(f"dp {coordinates['dp']} (replica {value}, shard {coordinates['dp_shard']})")
        elif name not in ("dp_shard",) and not (name == "dp" and "dp_replicate" in coordinates):
            text.append(f"{name} {value}")
    return ", ".join(text)


def _mesh_rows(mesh: Mapping[str, Any]) -> Rows:
    dims = " x ".join(f"{name} {size}" for name, size in mesh["dims"])
    rows = [("mesh", f"{dims} (row-major: the last dim's ranks are adjacent)")]
    previous = -1
    for entry in mesh["ranks"]:
        if entry["rank"] != previous + 1:
            rows.append(("  ...", f"ranks {previous + 1}..{entry['rank'] - 1} not shown"))
        previous = entry["rank"]
        groups = "; ".join(f"{name} group {_steps(ranks)}" for name, ranks in entry["groups"].items())
        rows.append((f"  rank {entry['rank']}", f"{_coordinates(entry['coordinates'])}  [{groups}]"))
    leaders = mesh["stage_leaders"]
    rows.append(("  stage leaders", ("ranks " if len(leaders) > 1 else "rank ") + _steps(leaders)))
    return rows


def _memory_per_rank_rows(memory: Mapping[str, Any]) -> Rows:
    if "unavailable" in memory:
        return [("memory per rank", f"no estimate: {memory['unavailable']}")]
    stage = f" (worst stage: {memory['stage']} of {memory['stages']})" if memory["stages"] > 1 else ""
    parts = ", ".join(
        f"{label} {format_bytes(memory[key])}"
        for label, key in (("weights", "parameters"), ("grads", "gradients"), ("AdamW", "optimizer_state"),
                           ("transient weights", "transient_weights"), ("activations", "activations"))
    )  # fmt: skip
    shape = (
        f"micro-batch {memory['micro_batch_size']} x {memory['seq_len']} tokens"
        if memory.get("seq_len")
        else f"micro-batch {memory['micro_batch_size']}"
    )
    rows = [
        ("memory per rank", f"{format_bytes(memory['total'])}{stage}: {parts}"),
        ("  model", f"{memory['model_params']:,} parameters, {memory['params_per_rank']:,} per rank; "
                    f"{shape}, {memory['mixed_precision']}; an estimate (fntrain.plan.estimate)"),
    ]  # fmt: skip
    if "frozen_weights" in memory:
        rows.append(("  frozen model", f"{memory['frozen_params']:,} parameters (reference or teacher): "
                                       f"weights {format_bytes(memory['frozen_weights'])} per rank, in the total"))  # fmt: skip
    rows.extend(("  note", note) for note in memory.get("notes", []))
    return rows


def _checkpoint_rows(checkpoint: Mapping[str, Any]) -> Rows:
    if not checkpoint["enabled"]:
        return [("checkpoint", "off")]
    steps = checkpoint["steps"]
    text = f"steps {_steps(steps)} ({len(steps)} saves)"
    if checkpoint.get("save_every_minutes"):
        text += f", and every {checkpoint['save_every_minutes']:g} min"
        text += " (temporary)" if checkpoint.get("time_based_temporary") else ""
    if checkpoint.get("keep_last"):
        text += f", keep last {checkpoint['keep_last']}"
    if checkpoint.get("keep_last") and checkpoint.get("keep_best"):
        text += " + the best by val_loss" + ("" if (checkpoint.get("disk") or {}).get("kept_best", True) else
                                             " (none: no evaluation)")  # fmt: skip
    if checkpoint.get("dir"):
        text += f" -> {checkpoint['dir']}"
    rows = [("checkpoint", text)]
    if checkpoint.get("disk"):
        rows.extend(_disk_rows(checkpoint["disk"]))
    return rows


def _disk_rows(disk: Mapping[str, Any]) -> Rows:
    """One checkpoint's size, and the most the run's checkpoints take at once (an estimate)."""
    one = (f"~{format_bytes(disk['total'])} per checkpoint (weights {format_bytes(disk['weights'])}, "
           f"{disk['optimizer']} state {format_bytes(disk['optimizer_state'])}, headers "
           f"{format_bytes(disk.get('headers', 0))})")  # fmt: skip
    if disk.get("at_once") is None:
        most = "no limit: set --checkpoint.keep-last to bound it"
    else:
        most = f"at most ~{format_bytes(disk['at_once_bytes'])} ({disk['at_once']} at once)"
    rows = [("  disk", f"{one}; {most}; an estimate (fntrain.plan.checkpoint_disk)")]
    rows.extend(("  note", note) for note in disk.get("notes", []))
    return rows


def _profiler_rows(profiler: Mapping[str, Any], world: int) -> Rows:
    if profiler["enabled"]:
        window = profiler["steps"]
        span = f"steps {window[0]}..{window[1]}" if window else "no step"
        text = f"{span} (from {profiler['starts_at']}"
        text += ", partial: stops at TRAIN_END)" if profiler.get("partial") else ")"
        text += f" on {_ranks(profiler['ranks'], world)} -> {profiler['output']}"
        rows = [("profiler", text)]
    else:
        rows = [("profiler", "off")]
    rows.extend(("  note", note) for note in profiler.get("notes", []))
    return rows


def _memory_rows(memory: Mapping[str, Any], world: int) -> Rows:
    if memory["enabled"]:
        window = memory["recorded_steps"]
        span = f"steps {window[0]}..{window[1]}" if window else "no step"
        text = (
            f"{span} (from {memory['starts_at']}, written {memory['writes_at']}); records on "
            f"{_ranks(memory['recording_ranks'], world)}, writes on "
            f"{_ranks(memory['writing_ranks'], world) if memory['writing_ranks'] else 'no rank'}"
            f" -> {memory['save_path']}"
        )
        rows = [("memory", text)]
    else:
        rows = [("memory", "off")]
    if memory.get("mem_info"):
        rows.append(("memory info", f"peak memory logged on {_ranks(memory['mem_info_ranks'], world)}"))
    if "frozen_weights" in memory:
        rows.append(("  frozen model", f"{memory['frozen_params']:,} parameters (reference or teacher): "
                                       f"weights {format_bytes(memory['frozen_weights'])} per rank, in the total"))  # fmt: skip
    rows.extend(("  note", note) for note in memory.get("notes", []))
    return rows
