"""A few steps of a MoE tiny GPT at one layout (strategy, ep size), for tests/models/test_moe_distributed.py.

    python -m tests.models.moe_worker none 1 OUT [cases]                     # the one-process reference
    torchrun --nproc_per_node=2 -m tests.models.moe_worker fsdp2 2 OUT       # experts split over 2 ranks

The global batches are tests/runtime/dist_worker.py's (labels masked unevenly over ranks, a micro-batch with no
loss token); rank 0 saves the losses, the first step's full gradients, the final full weights and the
router biases.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.models.moe import loss_with_router_aux, moe_step_end
from fntrain.runtime import RuntimeConfig, setup_runtime
from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.state import TrainState
from fntrain.step import StepSettings, make_train_step
from fntrain.step.optim import OptimizerConfig, build_optimizer
from tests.helpers.workers import gathered
from tests.runtime.dist_worker import CONTEXT, global_batches, rank_micro_batches

STEPS = 4
MODEL = ModelConfig(context=CONTEXT, n_layer=2, n_head=2, d_model=32, dropout=0.0, experts=4,
                    experts_per_token=2, shared_experts=1, expert_hidden=32, router_aux_loss_weight=0.1)  # fmt: skip
# case -> (optimizer, loss weighting, router bias rate)
CASES = {"token": ("adamw", "token", 0.0), "mean": ("sgd", "mean", 0.0), "bias": ("adamw", "token", 0.01)}


def run_moe_case(runtime, parallel: ParallelConfig, case: str) -> dict:
    optimizer_name, weighting, bias_rate = CASES[case]
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(**{**MODEL.__dict__, "router_bias_rate": bias_rate}))
    model = parallelize(model, runtime, parallel)
    lr = 0.1 if optimizer_name == "sgd" else 1e-3
    optimizer = build_optimizer(OptimizerConfig(name=optimizer_name, lr=lr, weight_decay=0.1), model).optimizer
    first_grads: dict[str, torch.Tensor] = {}

    def capture(opt, args, kwargs):
        if not first_grads:
            first_grads.update({name: gathered(p.grad) for name, p in model.named_parameters()})

    optimizer.register_step_pre_hook(capture)
    group = data_parallel_group(runtime)
    step_fn = make_train_step(model, loss_with_router_aux, optimizer, settings=StepSettings(max_grad_norm=1.0,
                              loss_weighting=weighting, device=runtime.device, dp_size=runtime.dp_size, dp_group=group),
                              step_end=moe_step_end(model, group))  # fmt: skip
    losses, aux, state = [], [], TrainState()
    for samples in global_batches()[:STEPS]:
        metrics = step_fn(state, rank_micro_batches(samples, runtime.dp_rank, runtime.dp_size))
        reported = torch.stack([metrics["loss"].detach(), metrics["moe/aux_loss"]])
        if runtime.distributed:
            dist.all_reduce(reported)  # the metrics hook's mean over ranks
            reported /= runtime.dp_size
        losses.append(float(reported[0]))
        aux.append(float(reported[1]))
        state = state.after_step()
    return {
        "losses": losses,
        "aux": aux,
        "grads": first_grads,
        "weights": {name: gathered(p) for name, p in model.named_parameters()},
        "biases": {name: b.detach().clone() for name, b in model.named_buffers() if name.endswith("expert_bias")},
    }


def main(argv: list[str]) -> None:
    strategy, ep_size, out = argv[0], int(argv[1]), argv[2]
    cases = argv[3].split(",") if len(argv) > 3 else list(CASES)
    parallel = ParallelConfig(strategy=strategy, ep_size=ep_size)
    with setup_runtime(RuntimeConfig(device="cpu"), parallel, seed=0) as runtime:
        results = {case: run_moe_case(runtime, parallel, case) for case in cases}
        results["layout"] = (runtime.world_size, runtime.dp_size, runtime.ep_size)
        if runtime.is_main:
            torch.save(results, out)


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
