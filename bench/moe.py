"""MoE step cost under expert parallelism (2 processes, gloo, CPU): ratios measured in one run.

Rows (medians of interleaved repeats of one training step of a MoE tiny GPT, 8 experts, top-2):
- loop / fntrain: the same step with the MoE layer's token grouping written as the usual hand-written
  loop over experts (`torch.where` per expert to gather its tokens, `index_add_` per expert to scatter
  them back: transformers' Mixtral/Qwen-MoE form) around the same all-to-all exchange, against
  fntrain's one stable sort and one scatter.
- ep 2 / ep 1: the step with the experts split over the 2 ranks (tokens exchanged with all-to-all) against
  the experts replicated on both (FSDP2 over dp 2, no exchange): the dispatch's step-time cost, less the
  expert compute and memory it saves.

Run: `torchrun --nproc_per_node=2 -m bench.moe [--repeats N]` (rank 0 prints the table).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.models.moe import MoE, loss_with_router_aux, moe_step_end, route
from fntrain.runtime import RuntimeConfig, setup_runtime
from fntrain.runtime.expert_parallel import combine, dispatch, plan_exchange
from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.state import TrainState
from fntrain.step import StepSettings, make_train_step
from fntrain.step.optim import OptimizerConfig, build_optimizer

MODEL = ModelConfig(context=64, n_layer=2, n_head=4, d_model=64, experts=8, experts_per_token=2, expert_hidden=128)
BATCH = 8  # per rank


def _loop_forward(self: MoE, x: torch.Tensor) -> torch.Tensor:
    """The hand-written MoE forward: tokens gathered and scattered back one expert at a time."""
    rows = x.reshape(-1, x.size(-1))
    routing = route(self.router(rows), self.top_k)
    picks = [torch.where(routing.experts == e) for e in range(self.experts.num_experts)]
    gathered = torch.cat([rows[token] for token, _ in picks])
    counts = torch.stack([torch.tensor(token.numel()) for token, _ in picks])
    experts = self.experts
    w_in, w_out = (w.to_local() if hasattr(w, "to_local") else w for w in (experts.w_in, experts.w_out))
    exchange = plan_exchange(counts, experts.ep_group)
    local = dispatch(gathered, exchange, experts.ep_group)
    pieces = torch.split(local, exchange.local_counts)
    outputs = torch.cat([torch.nn.functional.gelu(p @ w_in[e]) @ w_out[e] for e, p in enumerate(pieces)])
    back = combine(outputs, exchange, experts.ep_group)
    out, start = torch.zeros_like(rows), 0
    for token, slot in picks:
        end = start + token.numel()
        out.index_add_(0, token, back[start:end] * routing.weights[token, slot].unsqueeze(-1))
        start = end
    self.aux_loss = None
    return out.view_as(x)


def _step(runtime: Any, ep: int, loop: bool) -> Any:
    parallel = ParallelConfig(strategy="fsdp2", ep_size=ep)
    runtime = dataclasses.replace(runtime, ep_size=ep)  # ep 1: FSDP2 over the mesh's flattened "dp"
    torch.manual_seed(0)
    model = parallelize(TinyGPT(MODEL), runtime, parallel)
    if loop:
        for module in model.modules():
            if isinstance(module, MoE):
                module.forward = _loop_forward.__get__(module)
    optimizer = build_optimizer(OptimizerConfig(lr=1e-3), model).optimizer
    group = data_parallel_group(runtime)
    step = make_train_step(model, loss_with_router_aux, optimizer, settings=StepSettings(dp_size=runtime.dp_size, dp_group=group),
                           step_end=moe_step_end(model, group))  # fmt: skip
    ids = torch.randint(0, 256, (BATCH, MODEL.context), generator=torch.Generator().manual_seed(runtime.rank))

    def run() -> float:
        dist.barrier()
        start = time.perf_counter()
        step(TrainState(), [{"input_ids": ids, "labels": ids}])
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return float(elapsed)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with setup_runtime(RuntimeConfig(device="cpu"), ParallelConfig(strategy="fsdp2", ep_size=2), seed=0) as runtime:
        variants = {"ep2": _step(runtime, 2, False), "loop": _step(runtime, 2, True), "ep1": _step(runtime, 1, False)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for run in variants.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, run in variants.items():  # interleaved: load drifts hit every variant alike
                times[name].append(run())
        if runtime.is_main:
            median = {name: statistics.median(values) for name, values in times.items()}
            for row, (top, bottom) in {"loop / fntrain": ("loop", "ep2"), "ep 2 / ep 1": ("ep2", "ep1")}.items():
                low, high = _spread(times[top], times[bottom])
                print(f"{row:16s}{median[top] / median[bottom]:.2f}x  (paired ratios' quartiles {low:.2f}-{high:.2f}; "
                      f"{median[top] * 1e3:.1f} ms vs {median[bottom] * 1e3:.1f} ms, {args.repeats} rounds)")  # fmt: skip


def _spread(top: list[float], bottom: list[float]) -> tuple[float, float]:
    """The quartiles of the per-round ratios (each round ran both variants back to back)."""
    quartiles = statistics.quantiles([a / b for a, b in zip(top, bottom, strict=True)], n=4)
    return quartiles[0], quartiles[2]


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(main)  # os._exit under torchrun: see fntrain/runtime/process.py
