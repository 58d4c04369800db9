"""LoRA against full fine-tuning of the same Hugging Face model: step time (interleaved rounds of K
steps, paired per-round ratios) and the memory of what training keeps (trainable weights' gradients and AdamW
moments; on CUDA also the peak allocated memory of a step).

The model is a Llama built here from a config (nothing is downloaded), wide enough that its matrices,
not Python overhead, dominate a step. Both variants run fntrain's optimizer builder and train step;
LoRA (rank 8 on every linear layer but the head, through peft) differs only in `apply_lora`.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from bench.harness import Row, bench_main, interleave, paired_ratio_row, ratio_row

RANK = 8


def _model(device: torch.device, lora: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fntrain.models.lora import LoraConfig, apply_lora

    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    return apply_lora(model, LoraConfig(rank=RANK, alpha=16.0), seed=0) if lora else model


def _train_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of gradients + optimizer state, trainable parameter count) after at least one step."""
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    moments = sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    return grads + moments, sum(p.numel() for p in model.parameters() if p.requires_grad)


def run(quick: bool = False) -> list[Row]:
    from fntrain.state import TrainState
    from fntrain.step import StepSettings, causal_lm_loss, make_train_step
    from fntrain.step.optim import OptimizerConfig, build_optimizer

    logging.getLogger("fntrain").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    steps, repeats = (2, 2) if quick else (3, 11)
    batch_size, context = (4, 128) if device.type == "cpu" else (16, 256)
    ids = torch.randint(0, 4096, (batch_size, context), generator=torch.Generator().manual_seed(1)).to(device)
    batch = [{"input_ids": ids, "labels": ids}]

    variants, built = {}, {}
    for name in ("full", "lora"):
        model = _model(device, lora=name == "lora")
        optimizer = build_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.0), model).optimizer
        step_fn = make_train_step(model, causal_lm_loss, optimizer, settings=StepSettings(max_grad_norm=1.0))
        built[name] = (model, optimizer, step_fn)

        def round_(step_fn=step_fn) -> int:
            for _ in range(steps):
                step_fn(TrainState(), batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return steps

        variants[name] = round_

    peaks = {}
    if device.type == "cuda":  # one step each from a clean peak counter: what a step allocates at most
        for name, (_, _, step_fn) in built.items():
            step_fn(TrainState(), batch)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step_fn(TrainState(), batch)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated()
    # On CPU (one torch thread) CPU seconds of this process: what other processes take is not counted.
    timing = interleave(variants, repeats=repeats, clock=time.perf_counter if device.type == "cuda" else time.process_time)
    state = {name: _train_state_bytes(model, optimizer) for name, (model, optimizer, _) in built.items()}
    full_bytes, full_params = state["full"]
    lora_bytes, lora_params = state["lora"]
    where = f"{device.type}, Llama 4x512, batch {batch_size}x{context}, rank {RANK} all-linear"
    rows = [
        paired_ratio_row(
            "LoRA step time / full fine-tuning",
            timing,
            "lora",
            "full",
            unit="ms",
            goal_ratio=None,
            note=f"{where}; the frozen base still runs forward and the activations' backward",
        ),
        ratio_row(
            "LoRA trainable parameters / full",
            lora_params,
            full_params,
            unit="params",
            goal_ratio=0.05,
            note="adapter matrices only; the base weights are frozen (requires_grad=False)",
        ),
        ratio_row(
            "LoRA gradients + AdamW state / full",
            lora_bytes / 2**20,
            full_bytes / 2**20,
            unit="MiB",
            goal_ratio=0.05,
            note="bytes of .grad and optimizer moments after a step (what fine-tuning adds to the weights)",
        ),
    ]
    if peaks:
        rows.append(
            ratio_row(
                "LoRA peak step memory / full",
                peaks["lora"] / 2**20,
                peaks["full"] / 2**20,
                unit="MiB",
                goal_ratio=None,
                note="torch.cuda.max_memory_allocated over one step (weights and activations included)",
            )
        )
    return rows


if __name__ == "__main__":
    bench_main(run, "LoRA vs full fine-tuning", __doc__)
