"""`parallelize(model, runtime, strategy)`: none | DDP | FSDP2, plus mixed precision (§5) [S21], and
its `ParallelConfig`.

Everything here is torch.distributed's own machinery: `DistributedDataParallel`, FSDP2's
`fully_shard` over the runtime's DeviceMesh (1-D, or 2-D replicate x shard for HSDP) with a
`MixedPrecisionPolicy`, composable activation checkpointing and per-block `torch.compile`. fntrain
adds only the choice and the order: activation checkpointing -> compile -> data parallel (what
torchtitan does). The mesh's groups are looked up in `fntrain.runtime.groups`; what the step needs
for mixed precision (autocast dtype, gradient scaler, loss context) is `fntrain.runtime.precision`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fntrain.config import ConfigError, require_bool, require_choice, require_int, require_str
from fntrain.runtime.expert_parallel import expert_modules, shard_experts
from fntrain.runtime.groups import DP_CP, HSDP_DIMS, data_parallel_group, hsdp_shape, mesh_has_dims
from fntrain.runtime.pipeline import PP_SCHEDULES, PipelineSplit, split_stage
from fntrain.runtime.runtime import Runtime

__all__ = [
    "STRATEGIES", "MIXED_PRECISIONS", "LOW_PRECISION_DTYPES", "CP_STYLES", "ParallelConfig",
    "check_compile_backend", "parallelize", "transformer_blocks",
]  # fmt: skip

log = logging.getLogger(__name__)

STRATEGIES = ("none", "ddp", "fsdp2")
MIXED_PRECISIONS = ("fp32", "bf16", "fp16")
LOW_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # mixed_precision -> compute dtype
CP_STYLES = ("ulysses", "ring")  # the styles fntrain.step.context_parallel implements


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices and in which precision it computes."""

    strategy: Literal["none", "ddp", "fsdp2"] = "none"
    """none (one process), ddp (replicated weights, all-reduced gradients) or fsdp2 (sharded weights, gradients and optimizer state via fully_shard)."""
    mixed_precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype. bf16/fp16: autocast under none/ddp, a MixedPrecisionPolicy (low-precision params, fp32 gradient reduction) under fsdp2; fp16 adds a gradient scaler (sharded under fsdp2)."""
    reshard_after_forward: bool = True
    """fsdp2: free each block's gathered weights after its forward and gather them again in backward (less memory, more communication)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them."""
    compile: bool = False
    """torch.compile each transformer block (in place, so parameter names do not change)."""
    compile_backend: str = "inductor"
    """torch.compile backend (inductor, aot_eager, eager, ...)."""
    ddp_bucket_cap_mb: int = 25
    """ddp: gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """ddp: tolerate parameters that get no gradient in some steps (costs a graph traversal per step)."""
    tp_size: int = 1
    """Tensor-parallel degree: each block's matrices split over this many ranks (within a node); the recipe must have a tensor-parallel plan."""
    pp_size: int = 1
    """Pipeline stages: the blocks split by count over this many ranks; needs fixed-shape micro-batches and a recipe with a pipeline split."""
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b (one forward, one backward: fewer activations held)."""
    loss_parallel: bool = True
    """Tensor parallelism: compute the cross-entropy on the vocabulary shards instead of gathering the full logits."""
    cp_size: int = 1
    """Context-parallel degree: each sequence split over this many ranks (they read the same batch); attention heads and the sequence length must divide by it; needs ddp or fsdp2."""
    cp_style: Literal["ulysses", "ring"] = "ulysses"
    """Context parallelism: ulysses (all-to-all between sequence and heads around attention, any device) or ring (torch's ring attention, CUDA/NPU only, causal attention without document masks)."""
    ep_size: int = 1
    """Expert-parallel degree: each MoE layer's experts split over this many ranks, borrowed from the data-parallel ranks (must divide them); needs fsdp2 and a model with experts."""
    replicate: int = 1
    """fsdp2: HSDP replica groups R (e.g. nodes), sharded within one, all-reduced across; divides dp."""
    meta_init: bool = False
    """Build on the meta device, then allocate and initialize only each rank's shards (same weights)."""

    def validate(self, prefix: str = "parallel") -> None:
        require_choice(f"{prefix}.strategy", self.strategy, STRATEGIES)
        require_choice(f"{prefix}.mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        require_bool(f"{prefix}.reshard_after_forward", self.reshard_after_forward)
        require_bool(f"{prefix}.activation_checkpointing", self.activation_checkpointing)
        require_bool(f"{prefix}.compile", self.compile)
        require_str(f"{prefix}.compile_backend", self.compile_backend, non_empty=True)
        if self.compile:  # only then is the backend used (and torch._dynamo worth importing)
            check_compile_backend(self.compile_backend, f"{prefix}.compile_backend")
        require_int(f"{prefix}.ddp_bucket_cap_mb", self.ddp_bucket_cap_mb, min=1)
        require_bool(f"{prefix}.find_unused_parameters", self.find_unused_parameters)
        require_choice(f"{prefix}.cp_style", self.cp_style, CP_STYLES)
        for name in ("tp_size", "pp_size", "cp_size", "ep_size"):
            require_int(f"{prefix}.{name}", getattr(self, name), min=1)
        require_choice(f"{prefix}.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        require_bool(f"{prefix}.loss_parallel", self.loss_parallel)
        require_int(f"{prefix}.replicate", self.replicate, min=1)
        self._validate_model_parallel(prefix)
        if self.replicate > 1 and self.strategy != "fsdp2":
            raise ValueError(
                f"{prefix}.replicate={self.replicate} needs {prefix}.strategy 'fsdp2' (HSDP), "
                f"got {self.strategy!r}"
            )
        require_bool(f"{prefix}.meta_init", self.meta_init)
        self._validate_expert_parallel(prefix)

    def _validate_expert_parallel(self, prefix: str) -> None:
        """Expert parallelism shards experts over part of the data-parallel ranks: FSDP2 does the rest."""
        if self.ep_size == 1:
            return
        if self.strategy != "fsdp2":
            raise ValueError(f"{prefix}.ep_size={self.ep_size} needs {prefix}.strategy 'fsdp2', got {self.strategy!r}")
        for name in ("replicate", "pp_size", "tp_size", "cp_size"):
            if getattr(self, name) > 1:
                raise ValueError(f"{prefix}.ep_size={self.ep_size} cannot be combined with {prefix}.{name}={getattr(self, name)} yet")
        if self.meta_init:
            raise ValueError(f"{prefix}.meta_init is not supported with {prefix}.ep_size={self.ep_size} yet")

    def _validate_model_parallel(self, prefix: str) -> None:
        """The combinations tensor and pipeline parallelism support."""
        model_parallel = [
            f"{prefix}.{n}={getattr(self, n)}" for n in ("tp_size", "pp_size") if getattr(self, n) > 1
        ]
        if not model_parallel:
            return
        if self.strategy == "ddp":
            raise ValueError(
                f"{prefix}.strategy 'ddp' cannot be combined with {' and '.join(model_parallel)}: "
                f"use {prefix}.strategy fsdp2 for the data-parallel dimension"
            )
        if self.pp_size > 1 and self.mixed_precision == "fp16":
            raise ValueError(
                f"{prefix}.mixed_precision 'fp16' needs a gradient scaler, which pipeline schedules do not "
                f"apply: use bf16 with {prefix}.pp_size={self.pp_size}"
            )
        if self.pp_size > 1 and self.meta_init:
            raise ValueError(f"{prefix}.meta_init is not supported with {prefix}.pp_size={self.pp_size} yet")


def check_compile_backend(name: str, field: str = "parallel.compile_backend") -> str:
    """`name` when `torch.compile(backend=name)` knows it (the backends torch._dynamo registers,
    debugging ones and those of installed plugins such as torch_npu included); else a `ConfigError`
    naming `field`, the value and the usual choices, before any model is built (torch.compile would
    only fail at the first forward). Imports torch._dynamo (about a second)."""
    from torch._dynamo import list_backends  # import time: only a run that compiles pays for it

    known = list_backends(exclude_tags=())
    if name not in known:
        usual = sorted({*list_backends(), "eager", "aot_eager"} & set(known))
        raise ConfigError(f"{field} {name!r} is not a torch.compile backend; use one of {', '.join(usual)}")
    return name


def _as_config(strategy: str | ParallelConfig) -> ParallelConfig:
    if isinstance(strategy, ParallelConfig):
        return strategy
    require_choice("parallel.strategy", strategy, STRATEGIES)
    return ParallelConfig(strategy=strategy)  # type: ignore[arg-type]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to wrap one by one: Hugging Face's `_no_split_modules` classes when the
    model names them, else the children of its longest `nn.ModuleList`; [] when there is neither."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        found = [m for m in model.modules() if m is not model and type(m).__name__ in no_split]
        if found:
            return found
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > 0]
    if not lists:
        return []
    longest = max(lists, key=len)  # a pipeline stage keeps its blocks in a ModuleDict (names unchanged)
    return list(longest.values() if isinstance(longest, nn.ModuleDict) else longest)


def _data_parallel_mesh(runtime: Runtime, replicate: int = 1) -> Any:
    """The mesh fully_shard shards over: the data-parallel dim, or under HSDP (`replicate` > 1) the
    2-D (dp_replicate, dp_shard) mesh."""
    mesh = runtime.mesh
    if replicate > 1:
        if mesh is None:  # a process group set up outside setup_runtime: lay out the world here
            from torch.distributed.device_mesh import init_device_mesh

            return init_device_mesh(
                runtime.device.type, hsdp_shape(dist.get_world_size(), replicate), mesh_dim_names=HSDP_DIMS
            )
        if not mesh_has_dims(mesh, *HSDP_DIMS) or mesh[HSDP_DIMS].size(0) != replicate:
            raise ValueError(
                f"parallel.replicate={replicate} but the runtime mesh {mesh.mesh_dim_names} has no "
                f"{replicate} x dp_shard layout: build the runtime with setup_runtime(config, parallel) "
                "from the same ParallelConfig"
            )
        return mesh[HSDP_DIMS]
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(runtime.device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    if runtime.cp_size > 1:
        return mesh[DP_CP]  # FSDP2 over the flattened (dp, cp) mesh, as torchtitan shards over dp_shard_cp
    if mesh.ndim > 1:
        return mesh["dp"]  # a dim of the mesh, or HSDP's (dp_replicate, dp_shard) flattened
    return mesh


def _checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    # Composable (hook-based) checkpointing leaves the module tree and the parameter names as they
    # were, so checkpoints do not depend on whether activation checkpointing was on.
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def _compile_blocks(blocks: Sequence[nn.Module], backend: str) -> None:
    for block in blocks:
        block.compile(backend=backend)  # in place: parameter names unchanged


def _apply_ddp(model: nn.Module, runtime: Runtime, config: ParallelConfig) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [runtime.device.index] if runtime.device.type in ("cuda", "npu") else None
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=data_parallel_group(runtime),
        bucket_cap_mb=config.ddp_bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
    )


def _apply_fsdp2(
    model: nn.Module, runtime: Runtime, config: ParallelConfig, blocks: Sequence[nn.Module]
) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _data_parallel_mesh(runtime, config.replicate)
    if config.mixed_precision == "fp32":
        policy = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(
            param_dtype=LOW_PRECISION_DTYPES[config.mixed_precision], reduce_dtype=torch.float32
        )
    if runtime.ep_size > 1:
        for experts in expert_modules(model):
            # Expert weights: sharded over ep already, FSDP2 shards them over the rest of dp. Their
            # gradients sum every ep peer's tokens, so they are divided by the whole dp size, as the
            # dense gradients are, not by dp_mod_ep's (torchtitan does the same).
            fully_shard(experts, mesh=runtime.mesh["dp_mod_ep"], mp_policy=policy,
                        reshard_after_forward=config.reshard_after_forward)  # fmt: skip
            experts.set_gradient_divide_factor(float(runtime.dp_size))
            if runtime.backend == "gloo" and runtime.dp_size > runtime.ep_size:
                # A divide factor makes a reduce-scatter over several ranks use PREMUL_SUM, which gloo
                # lacks: sum, then divide (over one rank FSDP2 divides without a collective).
                experts.set_force_sum_reduction_for_comms(True)
    for index, block in enumerate(blocks):
        # The last block's weights are needed again as soon as backward starts: keeping them
        # gathered saves one all-gather per step (torchtitan does the same).
        reshard = config.reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def parallelize(
    model: nn.Module,
    runtime: Runtime,
    strategy: str | ParallelConfig = "none",
    *,
    blocks: Sequence[nn.Module] | None = None,
    tensor_parallel: Callable[[nn.Module, Any, bool], None] | None = None,
    pipeline: PipelineSplit | None = None,
) -> nn.Module:
    """Return `model` ready to train under `strategy` (a name or a full `ParallelConfig`).

    The model must already sit on `runtime.device`, or under fsdp2 have its parameters on the meta
    device (`fntrain.runtime.materialize.build_model` then materializes only the shards). Order (what
    torchtitan does): pipeline split (`runtime.pp_size` > 1: this rank keeps its stage, cut by
    `pipeline`) -> tensor parallelism (`runtime.tp_size` > 1: `tensor_parallel(model, tp_mesh,
    loss_parallel)`) -> expert parallelism (`runtime.ep_size` > 1: the experts modules' weights sharded
    over the mesh's "ep", `fntrain.runtime.expert_parallel`) -> activation checkpointing -> compile ->
    data parallelism (under ep, each experts module sharded by FSDP2 over "dp_mod_ep" first). With `replicate` > 1,
    fsdp2 shards over the runtime's 2-D (dp_replicate, dp_shard) mesh (HSDP). `blocks` are the
    repeated submodules that get checkpointed, compiled and sharded one by one (default:
    `transformer_blocks(model)`). Under fsdp2 the model is modified in place and returned; under ddp
    the returned wrapper must be used for training (and given to the optimizer builder).
    """
    config = _as_config(strategy)
    config.validate("parallel")
    _check_strategy(config, runtime)
    if runtime.pp_size > 1:
        if pipeline is None:
            raise ValueError(f"--parallel.pp-size {runtime.pp_size}: this model has no pipeline split")
        split_stage(model, pipeline, stage=runtime.pp_rank, stages=runtime.pp_size)
    if runtime.tp_size > 1:
        if tensor_parallel is None:
            raise ValueError(f"--parallel.tp-size {runtime.tp_size}: this model has no tensor-parallel plan")
        tensor_parallel(model, runtime.mesh["tp"], config.loss_parallel)
    if runtime.ep_size > 1:
        shard_experts(model, runtime.mesh["ep"])
    present = {id(module) for module in model.modules()}
    blocks = [b for b in blocks if id(b) in present] if blocks is not None else transformer_blocks(model)
    if (config.activation_checkpointing or config.compile or config.strategy == "fsdp2") and not blocks:
        log.warning("no repeated blocks found in %s: wrapping the whole model only", type(model).__name__)
    if config.activation_checkpointing:
        _checkpoint_blocks(blocks)
    if config.compile:
        _compile_blocks(blocks, config.compile_backend)
    if config.strategy == "ddp":
        return _apply_ddp(model, runtime, config)
    if config.strategy == "fsdp2":
        return _apply_fsdp2(model, runtime, config, blocks)
    return model


def _check_strategy(config: ParallelConfig, runtime: Runtime) -> None:
    if config.strategy == "none":
        if runtime.dp_size > 1:
            raise ValueError(
                f"parallel.strategy 'none' cannot train with {runtime.dp_size} data-parallel ranks "
                "(their gradients would never be combined): use ddp or fsdp2"
            )
        if runtime.cp_size > 1:
            raise ValueError(
                f"--parallel.cp-size {runtime.cp_size} needs --parallel.strategy ddp or fsdp2 (each cp rank's "
                "gradients cover only its slice of the sequence)"
            )
    elif not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"parallel.strategy {config.strategy!r} needs an initialized process group: launch with "
            "torchrun (e.g. torchrun --nproc_per_node=2 -m recipes.tiny_gpt ...) and build the runtime "
            "with setup_runtime"
        )
    if (runtime.tp_size > 1 or runtime.pp_size > 1 or runtime.ep_size > 1) and runtime.mesh is None:
        raise RuntimeError("tensor, pipeline and expert parallelism need the runtime's DeviceMesh: use setup_runtime")
