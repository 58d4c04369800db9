"""Tensor parallelism from a table of module-name patterns (torch's `parallelize_module`) [issue 20].

    plan = tensor_parallel_plan({"tok": "embedding", "blocks.*.attn.[qkv]": "colwise",
                                 "blocks.*.attn.proj": "rowwise", "head": "output"})
    plan(model, runtime.mesh["tp"], loss_parallel=True)        # in place, before FSDP2

Styles (Megatron's layout, as torch.distributed.tensor.parallel provides it):
- "colwise": an `nn.Linear` whose output features are split over the tp ranks (its input is replicated);
- "rowwise": an `nn.Linear` whose input features are split; its partial outputs are all-reduced;
- "embedding": an `nn.Embedding` split over the vocabulary; the looked-up rows are all-reduced;
- "output": the output head, split over the vocabulary; its logits stay a DTensor sharded on the last dim
  (`loss_parallel`: the cross-entropy runs on the shards, `torch.distributed.tensor.parallel.loss_parallel`)
  or are gathered into a plain full tensor.
Every other parameter (norms, position embeddings) becomes a replicated DTensor on the tp mesh, its
module taking and returning plain tensors, so that all parameters live on one mesh: one gradient norm,
one foreach optimizer step and FSDP2 on top see a uniform model. Weights tied before (an output head
sharing the token embedding) are tied again after; both must be split the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fntrain.runtime.pipeline import tied_names

__all__ = [
    "TP_STYLES", "TensorParallelPlan", "tensor_parallel_plan", "parallel_style", "replicate_remaining", "is_dtensor",
]  # fmt: skip

TP_STYLES = ("colwise", "rowwise", "embedding", "output")
TensorParallelPlan = Callable[[nn.Module, Any, bool], None]
"""`plan(model, tp_mesh, loss_parallel)`: apply tensor parallelism to `model` in place."""


def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def parallel_style(name: str, loss_parallel: bool) -> Any:
    """torch's ParallelStyle for one of `TP_STYLES` (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "output":
        if loss_parallel:
            return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(output_layouts=Replicate())
    raise ValueError(f"tensor-parallel style must be one of {TP_STYLES}, got {name!r}")


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Point every name of a tied group at the first name's (now distributed) parameter."""
    for first, *others in groups:
        source = model.get_parameter(first)
        for name in others:
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            current = getattr(module, attr)
            if is_dtensor(current) and is_dtensor(source) and current.placements != source.placements:
                raise ValueError(
                    f"tied weights {first} and {name} are split differently by the tensor-parallel plan "
                    f"({source.placements} vs {current.placements})"
                )
            setattr(module, attr, source)


def replicate_remaining(model: nn.Module, tp_mesh: Any) -> None:
    """Make every parameter that is still a plain tensor a replicated DTensor on `tp_mesh`; its module
    takes plain (or DTensor) inputs and returns plain tensors, so the surrounding code is unchanged.
    Buffers are left alone (rotary frequencies and the like stay plain)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    def replicate_params(_name: str, module: nn.Module, mesh: Any) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = distribute_tensor(param.detach(), mesh, [Replicate()])
                module.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def to_dtensor(_module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(_module: nn.Module, output: Any, mesh: Any) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, replicate_params, input_fn=to_dtensor, output_fn=to_local)


def _matches(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` names a module of `model` (a pipeline stage lacks the other stages' parts)."""
    from fnmatch import fnmatch

    atoms = pattern.split(".")
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        if module is not None and len(parts) == len(atoms) and all(map(fnmatch, parts, atoms)):
            return True
    return False


def tensor_parallel_plan(styles: Mapping[str, str]) -> TensorParallelPlan:
    """A plan that applies `styles` ({module-name pattern: style}, `*` and `[...]` matching within one
    name part) with `parallelize_module`, ties tied weights again and replicates the rest (see the
    module doc). Patterns naming no module of the model are skipped (a pipeline stage has only part)."""
    for pattern, style in styles.items():
        if style not in TP_STYLES:
            raise ValueError(
                f"tensor-parallel style for {pattern!r} must be one of {TP_STYLES}, got {style!r}"
            )

    def plan(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        tied = tied_names(model)
        present = {p: parallel_style(s, loss_parallel) for p, s in styles.items() if _matches(model, p)}
        parallelize_module(model, tp_mesh, present)
        _retie(model, tied)
        replicate_remaining(model, tp_mesh)

    return plan
