"""Worker for tests/models/test_hf_tp.py: a tiny Llama split by `hf_tensor_parallel` over 2 ranks
matches the unsharded model (logits, summed cross-entropy, gradients).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.models.hf_tp_worker MODEL_DIR OUT.json

Rank 0 saves tiny Llamas (untied and tied embeddings) under MODEL_DIR; every rank loads each twice
with `from_pretrained` (a reference copy and one to split on a 1-D "tp" mesh), runs the same batch
(right padding, labels partly -100) with loss_parallel on and off, and rank 0 writes, per case, the
largest absolute differences to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fntrain.models.hf_tp import hf_tensor_parallel

VOCAB = 128
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64,
)  # fmt: skip
# name -> (model type, config overrides, attn_implementation)
MODELS = {
    "llama_untied_sdpa": ("llama", {"tie_word_embeddings": False}, "sdpa"),
    "llama_tied_sdpa": ("llama", {"tie_word_embeddings": True}, "sdpa"),
    "llama_untied_eager": ("llama", {"tie_word_embeddings": False}, "eager"),
    "llama_odd_vocab": ("llama", {"tie_word_embeddings": False, "vocab_size": VOCAB - 1}, "sdpa"),
    "qwen2_tied_sdpa": ("qwen2", {"tie_word_embeddings": True}, "sdpa"),  # q/k/v carry biases
    "qwen3_sdpa": ("qwen3", {"tie_word_embeddings": False, "head_dim": 16}, "sdpa"),  # per-head q/k norms
    "phi3_sdpa": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0}, "sdpa"),  # fused qkv, gathered
}


def save_tiny_model(directory: Path, model_type: str, overrides: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{"vocab_size": VOCAB, **TINY, **overrides})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def load(directory: Path, attn_implementation: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(directory), local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
    )


def fixed_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB - 1, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0  # right padding on the second row
    labels = input_ids.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[1, 8:] = -100
    labels[0, :3] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def one_process_reference(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    loss = summed_loss(logits, inputs["labels"])
    loss.backward()
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def sharded(
    model: torch.nn.Module, inputs: dict, loss_parallel: bool
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Logits (full), loss and full gradients of the split `model`; the loss and its backward run under
    loss_parallel() when the logits are vocab-sharded DTensors."""
    from contextlib import nullcontext

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert isinstance(logits, DTensor) == loss_parallel, type(logits)
    with loss_parallel_context() if loss_parallel else nullcontext():
        loss = summed_loss(logits, inputs["labels"])
        loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    grads = {name: full(param.grad).detach() for name, param in model.named_parameters()}
    return full(logits).detach(), full(loss).detach(), grads


def compare(name: str, directory: Path, attn: str, mesh, loss_parallel: bool) -> dict:
    from torch.distributed.tensor import DTensor

    inputs = fixed_batch()
    want_logits, want_loss, want_grads = one_process_reference(load(directory, attn), inputs)
    model = load(directory, attn)
    hf_tensor_parallel(model, mesh, loss_parallel)
    got_logits, got_loss, got_grads = sharded(model, inputs, loss_parallel)
    params = dict(model.named_parameters())
    assert got_grads.keys() == want_grads.keys(), (sorted(got_grads), sorted(want_grads))
    return {
        "logits": (got_logits - want_logits).abs().max().item(),
        "loss": (got_loss - want_loss).abs().item(),
        "loss_value": want_loss.item(),
        "grads": max((got_grads[key] - want_grads[key]).abs().max().item() for key in want_grads),
        "tied": bool(model.lm_head.weight is model.get_input_embeddings().weight),
        "plain_params": sorted(n for n, p in params.items() if not isinstance(p, DTensor)),
        "sharded_params": sorted(
            n for n, p in params.items() if isinstance(p, DTensor) and p.placements[0].is_shard()
        ),
    }


def main(model_root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    root = Path(model_root)
    if dist.get_rank() == 0:
        for name, (model_type, overrides, _) in MODELS.items():
            save_tiny_model(root / name, model_type, overrides)
    dist.barrier()
    results = {}
    for name, (_, _, attn) in MODELS.items():
        for loss_parallel in (True, False):
            results[f"{name}/loss_parallel={loss_parallel}"] = compare(
                name, root / name, attn, mesh, loss_parallel
            )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(*sys.argv[1:3]))  # os._exit under torchrun: see fntrain/runtime/process.py
