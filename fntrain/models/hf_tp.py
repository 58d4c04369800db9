"""Tensor parallelism for Hugging Face causal LMs, from the model's own declared plan.

    hf_tensor_parallel(model, tp_mesh, loss_parallel)   # in place, before data parallelism

transformers models declare how they split: `config.base_model_tp_plan` ({"layers.*.self_attn.q_proj":
"colwise", ...}) plus the class's `_tp_plan` ({"lm_head": "colwise_gather_output"}); transformers 5
merges them, prefixed, into `model.tp_plan` and adds the input embeddings ("embedding_rowwise"). This
module translates those style names into torch's own ParallelStyles and applies them with
`parallelize_module`, so every family that declares a plan of plain column / row splits (Llama, Qwen2,
Mistral, ...) works; other styles (packed, MoE, MLA) are refused with a ValueError naming the model.

Attention needs nothing else: transformers 5 reshapes q/k/v with -1 heads
(`view(*input_shape, -1, head_dim)`) and repeats k/v by the ratio of heads to kv heads, which both stay
right when each rank holds heads / tp of each. The remaining weights (norms) become replicated DTensors
(`fntrain.runtime.tensor_parallel.replicate_remaining`; no sequence parallelism): the residual stream is
whole on every rank, so their gradients are too.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

__all__ = [
    "SUPPORTED_STYLES",
    "declared_tp_plan",
    "resolve_tp_plan",
    "check_tp_divisible",
    "tp_styles",
    "hf_tensor_parallel",
]

SUPPORTED_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "rowwise_split_input",
    "embedding_rowwise",
    "replicated_with_grad_allreduce",
)
SPLIT_STYLES = SUPPORTED_STYLES[:-1]  # styles that split an nn.Linear / nn.Embedding
# transformers' names of the styles fntrain.runtime.tensor_parallel has (the input comes in whole for
# the embedding-like ones).
_AS_FNTRAIN_STYLE = {
    "colwise": "colwise", "rowwise": "rowwise", "embedding_rowwise": "embedding", "rowwise_split_input": "embedding",
}  # fmt: skip


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def declared_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan {module name pattern relative to `model`: style}: transformers 5's merged
    `model.tp_plan`, else (older versions) the base model's `config.base_model_tp_plan` under its prefix
    plus the class's `_tp_plan`. The output and input embeddings are always in it (vocabulary split),
    so logits can come out vocab-sharded and tied embeddings stay tied. ValueError when the config
    declares no base-model plan."""
    config = getattr(model, "config", None)
    if not (
        getattr(config, "base_model_tp_plan", None)
        or getattr(_text_config(model), "base_model_tp_plan", None)
    ):
        # An output head alone (a class `_tp_plan` without the base model's) would split nothing else.
        raise ValueError(
            f"model type {_model_type(model)!r} declares no tensor-parallel plan (config.base_model_tp_plan): "
            "fntrain cannot split it; run with --parallel.tp-size 1"
        )
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        base = dict(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        if base and prefix and getattr(model, prefix, None) is not None:
            base = {f"{prefix}.{key}": style for key, style in base.items()}
        plan = {**dict(getattr(type(model), "_tp_plan", None) or {}), **base}
    names = {module: name for name, module in model.named_modules()}
    embeddings = (
        (_output_embeddings(model), "colwise_gather_output"),
        (_input_embeddings(model), "embedding_rowwise"),
    )
    for module, style in embeddings:
        if module is not None and module in names and names[module] not in plan:
            plan[names[module]] = style
    return plan


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    return getter() if getter is not None else None


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if getter is not None else None


def resolve_tp_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan`'s patterns ("*" matches one name part) expanded to the names of `model`'s modules.

    ValueError, naming the model type, for a style outside SUPPORTED_STYLES, a pattern that matches no
    module (e.g. a PEFT wrapper moved the names), or a match that is neither nn.Linear nor nn.Embedding
    (torch's ParallelStyles split only those; LoRA layers are neither)."""
    model_type = _model_type(model)
    unsupported = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
    if unsupported:
        raise ValueError(
            f"model type {model_type!r} declares tensor-parallel styles fntrain does not support: "
            f"{', '.join(unsupported)} (supported: {', '.join(SUPPORTED_STYLES)}); run with --parallel.tp-size 1"
        )
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        matches = [name for name in modules if _matches(name, pattern)]
        if not matches:
            raise ValueError(
                f"model type {model_type!r}: its tensor-parallel plan names {pattern!r}, which matches no "
                f"module of {type(model).__name__} (a wrapper such as LoRA renames and replaces them)"
            )
        for name in matches:
            _check_module_fits(model, name, modules[name], style)
            resolved[name] = style
    return resolved


def _check_module_fits(model: nn.Module, name: str, module: nn.Module, style: str) -> None:
    """ValueError unless `module` can take `style`: the split styles need an nn.Linear / nn.Embedding;
    replicated_with_grad_allreduce is supported for per-head modules (Qwen3's q_norm / k_norm), whose
    parameters all end in head_dim, since their input is split on the heads dim."""
    model_type = _model_type(model)
    if style in SPLIT_STYLES and not isinstance(module, (nn.Linear, nn.Embedding)):
        raise ValueError(
            f"model type {model_type!r}: tensor parallelism splits nn.Linear and nn.Embedding only, "
            f"but {name} ({style}) is a {type(module).__name__}"
        )
    if style == "replicated_with_grad_allreduce":
        head_dim = _head_dim(model)
        shapes = [tuple(param.shape) for param in module.parameters()]
        if head_dim is None or any(not shape or shape[-1] != head_dim for shape in shapes):
            raise ValueError(
                f"model type {model_type!r}: {name} (replicated_with_grad_allreduce) has parameters of "
                f"shapes {shapes}; fntrain supports that style only for per-head modules (last dim "
                f"head_dim = {head_dim})"
            )


def _head_dim(model: nn.Module) -> int | None:
    config = _text_config(model)
    head_dim = getattr(config, "head_dim", None)
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if head_dim is None and isinstance(heads, int) and isinstance(hidden, int):
        head_dim = hidden // heads
    return head_dim


def _matches(name: str, pattern: str) -> bool:
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(  # "*" stays within one name part
        fnmatchcase(part, wanted) for part, wanted in zip(parts, pattern_parts, strict=True)
    )


def check_tp_divisible(model: nn.Module, tp_size: int) -> None:
    """ValueError unless `tp_size` divides the attention heads and the key/value heads: each rank holds
    whole heads (and whole groups of query heads per key/value head)."""
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for field_name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            raise ValueError(
                f"--parallel.tp-size {tp_size} must divide the model's {field_name} ({count}) "
                f"(model type {_model_type(model)!r}): each rank holds whole attention heads"
            )


def _parallel_style(style: str, is_output: bool, loss_parallel: bool) -> Any:
    """torch's ParallelStyle for a transformers style name. The output embeddings (lm_head) give
    vocab-sharded DTensor logits under loss_parallel, else full logits gathered on every rank."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from fntrain.runtime.tensor_parallel import parallel_style

    if style in _AS_FNTRAIN_STYLE:
        return parallel_style(_AS_FNTRAIN_STYLE[style], loss_parallel)
    if style == "replicated_with_grad_allreduce":
        # A per-head module (..., heads, head_dim) sees only this rank's heads: SequenceParallel over the
        # heads dim makes its weights Replicate DTensors, so their gradients (partial sums over the
        # local heads) are summed over the mesh by DTensor itself.
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    # colwise_gather_output: vocab-sharded logits for the output embeddings under loss_parallel, else gathered
    return parallel_style("output", loss_parallel and is_output)


def _refuse_adapters(model: nn.Module) -> None:
    """ValueError for a model carrying PEFT adapters (their layers hold a `base_layer`): splitting the
    base weight and the adapter's A/B consistently is not implemented."""
    adapted = [name for name, module in model.named_modules() if hasattr(module, "base_layer")]
    if adapted:
        raise ValueError(
            f"model type {_model_type(model)!r} carries LoRA/PEFT adapters ({adapted[0]}, ...), which tensor "
            "parallelism cannot split yet: use --parallel.tp-size 1 or turn LoRA off (lora.rank 0)"
        )


def tp_styles(model: nn.Module, loss_parallel: bool) -> dict[str, Any]:
    """{module name: torch ParallelStyle} for `model`: its declared plan, checked and expanded
    (`resolve_tp_plan`), each style name translated; the output embeddings give vocab-sharded DTensor
    logits when `loss_parallel`, else full ones."""
    _refuse_adapters(model)
    plan = resolve_tp_plan(model, declared_tp_plan(model))
    output_embeddings = _output_embeddings(model)
    modules = dict(model.named_modules())
    return {
        name: _parallel_style(style, modules[name] is output_embeddings, loss_parallel)
        for name, style in plan.items()
    }


def _tied_embeddings(model: nn.Module) -> bool:
    inputs, outputs = _input_embeddings(model), _output_embeddings(model)
    return inputs is not None and outputs is not None and outputs.weight is inputs.weight


def hf_tensor_parallel(model: nn.Module, tp_mesh: Any, loss_parallel: bool) -> None:
    """Split `model` (a transformers causal LM on its device, not meta) over the 1-D `tp_mesh` in place,
    following its declared plan (`tp_styles`). The logits come out as a DTensor sharded on the
    vocabulary (Shard(-1)) when `loss_parallel` (compute the loss under
    `torch.distributed.tensor.parallel.loss_parallel()`), else as a plain full tensor. Tied input and
    output embeddings stay one parameter (both split on the vocabulary); every other parameter becomes a
    replicated DTensor, so all parameters are DTensors on `tp_mesh`. ValueError for a model without
    a plan, an unsupported style, LoRA adapters or head counts `tp_mesh.size()` does not divide."""
    from torch.distributed.tensor.parallel import parallelize_module

    from fntrain.runtime.tensor_parallel import replicate_remaining

    check_tp_divisible(model, tp_mesh.size())
    styles = tp_styles(model, loss_parallel)
    tied = _tied_embeddings(model)
    parallelize_module(model, tp_mesh, styles)
    if tied:
        # parallelize_module gives each module its own new DTensor parameter; both are Shard(0) on the
        # vocabulary over the same mesh, so the output embeddings can share the input's again.
        _output_embeddings(model).weight = _input_embeddings(model).weight
    # The norms' weights become replicated DTensors too: every parameter then lives on the tp mesh, as
    # the gradient norm, foreach optimizers and FSDP2 on top expect.
    replicate_remaining(model, tp_mesh)
