"""Meta-device model building: construct without memory, parallelize, then materialize and fill.

    model = build_model(lambda: TinyGPT(cfg), runtime, parallel, fill=seeded_init(seed, post_init=TinyGPT._init))

Order: the factory runs under `params_on_meta()` (every parameter lands on the meta device: no storage,
no init compute, no RNG draw; buffers stay real, so non-persistent buffers such as rotary frequencies
keep their constructed values) -> fsdp2: `parallelize` first, so every parameter is a sharded DTensor
before it has storage -> `materialize` allocates each rank's local storage on the device -> `fill`
initializes or loads. ddp/none materialize and fill first (DDP broadcasts real weights when it wraps).

Under fsdp2 no rank ever holds the full model: storage is only ever allocated for local shards, and
seeded initialization works one module at a time on full-size copies of that module's own
parameters (the largest one bounds the extra memory).

Seeded initialization is identical to an eager build with the same seed (`seeded_init`): the RNG is
seeded as the eager path seeds it, then the model's own initializers are replayed in the order eager
construction runs them — each module's `reset_parameters()` in `model.modules()` order (construction
order for models that build each submodule where they register it), then `post_init` over the modules
in `nn.Module.apply` order. Each step runs on full-size CPU copies of the module's parameters (the
eager path initializes on CPU, so the same generator produces the same numbers), and each rank keeps
its shard. A model that initializes otherwise (an `nn.Parameter(torch.randn(...))` in `__init__`,
`nn.MultiheadAttention`'s `_reset_parameters`) passes its own `plan`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from fntrain.runtime.parallel import ParallelConfig, _as_config, parallelize
from fntrain.runtime.pipeline import PipelineSplit
from fntrain.runtime.runtime import Runtime

__all__ = [
    "InitStep",
    "params_on_meta",
    "build_on_meta",
    "materialize",
    "replay_plan",
    "init_weights",
    "seeded_init",
    "build_model",
    "build_seeded_model",
    "is_meta",
    "local_numel",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)
InitStep = tuple[nn.Module, Callable[[nn.Module], None]]
"""One initialization step: a function run on a module whose own parameters are full-size and real."""


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside the block every parameter registered on a module is moved to the meta device as it is
    registered, so the module's own `reset_parameters()` then runs on meta (no compute, no RNG draw).
    Buffers are left where they are created. The factory's `torch.empty` parameter storage is freed at
    once (it is never written). Not thread-safe: it patches `nn.Module.register_parameter`."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.is_meta:  # already meta: keep the object (tied weights stay tied)
            return
        registered = module._parameters[name]
        meta = registered.detach().to("meta")
        if type(registered) is nn.Parameter:
            module._parameters[name] = nn.Parameter(meta, requires_grad=registered.requires_grad)
        else:  # a Parameter subclass: rebuild it the way it was built
            kwargs = dict(registered.__dict__)
            kwargs["requires_grad"] = registered.requires_grad
            module._parameters[name] = type(registered)(meta, **kwargs)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_on_meta(factory: Callable[[], M]) -> M:
    """`factory()` with its parameters on the meta device (see `params_on_meta`)."""
    with params_on_meta():
        return factory()


def is_meta(tensor: torch.Tensor) -> bool:
    """True for a meta tensor, a DTensor whose local shard is on meta included."""
    local = getattr(tensor, "_local_tensor", None)
    return bool(tensor.is_meta or (local is not None and local.is_meta))


def materialize(model: M, device: torch.device | str) -> M:
    """Give every meta parameter and buffer uninitialized storage on `device` (a DTensor gets storage
    for its local shard only) and move the other tensors there; return `model`. Meta buffers' values
    are undefined until filled: they are named in a warning."""
    device = torch.device(device)
    meta_buffers = [name for name, buffer in model.named_buffers() if is_meta(buffer)]
    if meta_buffers:
        log.warning(
            "buffers on the meta device get uninitialized storage (initialize or load them): %s",
            ", ".join(meta_buffers),
        )
    # Like nn.Module.to_empty, but a tensor shared by several modules (tied weights) is materialized
    # once and parameters keep their identity (swap_tensors, as `_apply` does for FSDP2's DTensors),
    # so ties survive; real buffers keep their values. FSDP2 re-points its padded shards at the new
    # storage on its lazy init.
    moved: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is None or id(param) in moved:
                    continue
                moved[id(param)] = param
                if is_meta(param):
                    fresh = torch.empty_like(param, device=device)
                elif param.device != device:
                    fresh = param.to(device)
                else:
                    continue
                torch.utils.swap_tensors(param, nn.Parameter(fresh, requires_grad=param.requires_grad))
            for name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if id(buffer) not in moved:
                    moved[id(buffer)] = (
                        torch.empty_like(buffer, device=device) if is_meta(buffer) else buffer.to(device)
                    )
                module._buffers[name] = moved[id(buffer)]
    return model


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():  # nn.Module.apply's order: children first, then the module
        yield from _post_order(child)
    yield module


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def replay_plan(model: nn.Module, post_init: Callable[[nn.Module], None] | None = None) -> Iterator[InitStep]:
    """The steps eager construction runs: `reset_parameters()` of each module that has one, in
    `model.modules()` order, then `post_init` on every module in `model.apply(post_init)` order."""
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            yield module, _reset
    if post_init is not None:
        for module in _post_order(model):
            yield module, post_init


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


def _full_twin(param: torch.Tensor, init_device: torch.device, initialized: bool) -> torch.Tensor:
    """A full-size, plain copy of `param` on `init_device`: its current global value when it was
    initialized before (an all-gather for a DTensor), else uninitialized storage."""
    if _is_dtensor(param):
        if initialized:
            return param.full_tensor().to(init_device)  # type: ignore[attr-defined]
        return torch.empty(param.shape, dtype=param.dtype, device=init_device)
    if param.device == init_device:
        return param.detach()  # initialized in place: no copy
    if initialized:
        return param.detach().to(init_device)
    return torch.empty(param.shape, dtype=param.dtype, device=init_device)


def _write_back(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full value `full` into `param` (a DTensor keeps its shard)."""
    if _is_dtensor(param):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()  # type: ignore[attr-defined]
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )  # type: ignore[attr-defined]
        part = full[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))]
        local.copy_(part)
    elif full.data_ptr() != param.data_ptr():
        param.detach().copy_(full)


def init_weights(
    model: nn.Module, plan: Iterable[InitStep], *, init_device: torch.device | str = "cpu"
) -> nn.Module:
    """Run `plan` over `model`'s materialized parameters (plain or sharded DTensors) and return it.

    Each step's function sees its module with full-size plain copies of the module's own parameters
    on `init_device` (a copy holds the parameter's current value once an earlier step initialized it);
    afterwards every rank keeps its part. Steps run in the same order on every rank (the all-gathers
    of already-initialized DTensors are collectives)."""
    init_device = torch.device(init_device)
    initialized: set[int] = set()
    with torch.no_grad():
        for module, fn in plan:
            own = {name: p for name, p in module._parameters.items() if p is not None}
            twins: dict[int, nn.Parameter] = {}
            for param in own.values():
                if id(param) not in twins:
                    full = _full_twin(param, init_device, id(param) in initialized)
                    twins[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
            module._parameters.update({name: twins[id(p)] for name, p in own.items()})
            try:
                fn(module)
            finally:
                module._parameters.update(own)
            done: set[int] = set()
            for param in own.values():
                if id(param) not in done:
                    _write_back(param, twins[id(param)].detach())
                    done.add(id(param))
                    initialized.add(id(param))
    return model


def seeded_init(
    seed: int,
    *,
    post_init: Callable[[nn.Module], None] | None = None,
    plan: Callable[[nn.Module], Iterable[InitStep]] | None = None,
    init_device: torch.device | str = "cpu",
) -> Callable[[nn.Module], None]:
    """A `fill` for `build_model`: seed torch's RNG with `seed` (as `torch.manual_seed(seed)` before an
    eager build does) and run `plan(model)` (default: `replay_plan(model, post_init)`). Afterwards the
    weights and the global RNG state are those of the eager build, so dropout draws match too."""

    def fill(model: nn.Module) -> None:
        torch.manual_seed(seed)
        steps = plan(model) if plan is not None else replay_plan(model, post_init)
        init_weights(model, steps, init_device=init_device)

    return fill


def build_model(
    factory: Callable[[], nn.Module],
    runtime: Runtime,
    parallel: str | ParallelConfig,
    *,
    fill: Callable[[nn.Module], None],
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    tensor_parallel: Callable[[nn.Module, Any, bool], None] | None = None,
    pipeline: PipelineSplit | None = None,
) -> nn.Module:
    """Build `factory()` on the meta device, parallelize it, materialize it on `runtime.device` and
    `fill` it (`seeded_init(...)`, or a weight loader such as `fntrain.checkpoint.hf_load.hf_weights`).

    fsdp2: parallelize -> materialize -> fill (only local shards ever get storage); ddp / none:
    materialize -> fill -> parallelize. `blocks(model)` names the repeated blocks (default:
    `parallel.transformer_blocks`). `tensor_parallel` and `pipeline` go to `parallelize`. Returns what
    `parallelize` returns (the DDP wrapper under ddp)."""
    config = _as_config(parallel)
    model = build_on_meta(factory)
    chosen = list(blocks(model)) if blocks is not None else None
    how = {"blocks": chosen, "tensor_parallel": tensor_parallel, "pipeline": pipeline}
    if config.strategy == "fsdp2":
        model = parallelize(model, runtime, config, **how)
        materialize(model, runtime.device)
        fill(model)
        return model
    materialize(model, runtime.device)
    fill(model)
    return parallelize(model, runtime, config, **how)


def local_numel(model: nn.Module) -> int:
    """Elements this rank stores for `model`'s parameters (a DTensor counts its local shard). Count
    between steps: after a forward, FSDP2's root keeps its parameters gathered until backward."""
    total = 0
    for param in model.parameters():
        local: Any = param.to_local() if _is_dtensor(param) else param  # type: ignore[attr-defined]
        total += local.numel()
    return total


def build_seeded_model(
    factory: Callable[[], nn.Module],
    runtime: Runtime,
    parallel: str | ParallelConfig,
    *,
    seed: int,
    post_init: Callable[[nn.Module], None] | None = None,
    tensor_parallel: Callable[[nn.Module, Any, bool], None] | None = None,
    pipeline: PipelineSplit | None = None,
) -> nn.Module:
    """`factory()` initialised from `seed` and parallelized, on `runtime.device`: built eagerly after
    `torch.manual_seed(seed)`, or with `parallel.meta_init` on the meta device and filled by
    `seeded_init(seed, post_init=post_init)` to the same weights (only local shards under fsdp2).
    Every rank builds the same full model first, whatever tensor or pipeline parallelism then keeps."""
    config = _as_config(parallel)
    how = {"tensor_parallel": tensor_parallel, "pipeline": pipeline}
    if config.meta_init:
        return build_model(factory, runtime, config, fill=seeded_init(seed, post_init=post_init), **how)
    torch.manual_seed(seed)
    return parallelize(factory().to(runtime.device), runtime, config, **how)
