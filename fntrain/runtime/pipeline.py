"""Pipeline stages: a model's blocks split by count over the pipeline ranks [issue 20].

    split = PipelineSplit(layers="blocks", first=("tok", "pos"), last=("ln_f", "head"))
    stage = split_stage(model, split, stage=runtime.pp_rank, stages=runtime.pp_size)

A stage keeps its share of `layers` (contiguous, as even as possible, earlier stages taking the extra
ones), the `first` modules on stage 0 and the `last` modules on the last stage; everything else is set
to None (torchtitan's layout). Parameter names do not change (the kept layers sit in an `nn.ModuleDict`
keyed by their index), so a stage's state dict is a slice of the full model's and checkpoints load at any
pipeline size. The model's forward must skip parts that are None and, on a stage after the first, take
the previous stage's activations in place of the token ids (fntrain.models.gpt's TinyGPT does).

Tied weights (an output head sharing the token embedding) end up on two stages; `stage_ties` names
them so the step can add the two copies' gradients (torch's pipelining leaves that to the user).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["PipelineSplit", "stage_layers", "split_stage", "stage_ties", "tied_names", "PP_SCHEDULES"]

PP_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelineSplit:
    """Where a model's pipeline cut points are: the repeated `layers` (an `nn.ModuleList` attribute
    path), the modules only the first stage runs (`first`) and those only the last stage runs (`last`)."""

    layers: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The layer indices of each stage: contiguous, sizes differing by at most one (earlier stages
    take the extra ones). Every stage needs at least one layer: ValueError otherwise."""
    if stages > num_layers:
        raise ValueError(
            f"--parallel.pp-size {stages} needs at least one transformer block per stage, "
            f"but the model has {num_layers}"
        )
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _set(model: nn.Module, path: str, value: nn.Module | None) -> None:
    parent_name, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, value)


def split_stage(model: nn.Module, split: PipelineSplit, *, stage: int, stages: int) -> nn.Module:
    """Cut `model` down to pipeline stage `stage` of `stages` in place (see the module doc); returns it."""
    layers = model.get_submodule(split.layers)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"pipeline split: {split.layers!r} must be an nn.ModuleList, got {type(layers).__name__}"
        )
    ranges = stage_layers(len(layers), stages)
    everywhere = [
        name for name, _ in model.named_parameters() if len(_holders(name, split, ranges)) == stages
    ]
    if stages > 1 and everywhere:
        raise ValueError(
            f"pipeline split: {', '.join(everywhere)} would be on every stage (trained by one, saved by "
            "all): name its module in the split's `first` or `last`"
        )
    kept = ranges[stage]

    _set(model, split.layers, nn.ModuleDict({str(i): layers[i] for i in kept}))
    if stage != 0:
        for path in split.first:
            _set(model, path, None)
    if stage != stages - 1:
        for path in split.last:
            _set(model, path, None)
    return model


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several (tied weights: an output head sharing
    the token embedding), in registration order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def stage_ties(model: nn.Module, split: PipelineSplit, stages: int) -> list[dict[int, str]]:
    """Tied weights of the full `model` that land on more than one stage: for each, {stage: the name
    that stage holds it under} (e.g. {0: "tok.weight", 1: "head.weight"})."""
    layers = len(model.get_submodule(split.layers))
    ranges = stage_layers(layers, stages)
    ties = []
    for names in tied_names(model):
        holders: dict[int, str] = {}
        for name in names:
            for owner in _holders(name, split, ranges):
                holders.setdefault(owner, name)
        if len(holders) > 1:
            ties.append(holders)
    return ties


def _holders(name: str, split: PipelineSplit, ranges: list[range]) -> list[int]:
    """The stages that keep parameter `name` after `split_stage`."""
    prefix = split.layers + "."
    if name.startswith(prefix):
        index = int(name[len(prefix) :].split(".", 1)[0])
        return [stage for stage, kept in enumerate(ranges) if index in kept]
    if any(name == p or name.startswith(p + ".") for p in split.first):
        return [0]
    if any(name == p or name.startswith(p + ".") for p in split.last):
        return [len(ranges) - 1]
    return list(range(len(ranges)))  # neither cut away: every stage keeps it
