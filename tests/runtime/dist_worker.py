"""Worker for tests/runtime/test_distributed.py: trains the tiny GPT on a fixed global batch and saves what the
tests compare (step-1 gradients, per-step losses, final weights), for one strategy.

    python -m tests.runtime.dist_worker none OUT.pt                                # the 1-rank reference
    python -m torch.distributed.run --nproc_per_node=2 -m tests.runtime.dist_worker ddp OUT.pt

Every case sees the same global batches: GLOBAL samples per step, split into micro-batches of
MICRO samples; rank r of W reads the r-th contiguous W-th of each global batch. Labels are masked
unevenly (a whole micro-batch and most of one rank's tokens are ignored) so token weighting matters.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.runtime.groups import data_parallel_group
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.runtime.precision import autocast_dtype, build_grad_scaler
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step.optim import OptimizerConfig, build_optimizer
from tests.helpers.workers import gathered

STEPS = 5
GLOBAL = 8
MICRO = 2
CONTEXT = 16
MODEL = ModelConfig(context=CONTEXT, n_layer=2, n_head=2, d_model=32, dropout=0.0)
# (optimizer, loss weighting, mixed precision, steps)
CASES = {
    "sgd": ("sgd", "token", "fp32", STEPS),
    "adamw": ("adamw", "token", "fp32", STEPS),
    "sgd_mean": ("sgd", "mean", "fp32", STEPS),
    "bf16": ("adamw", "token", "bf16", 3),
    "fp16": ("adamw", "token", "fp16", 3),
    # nonfinite="skip": step 2's last micro-batch (rank 1's under 2 ranks) has a NaN loss
    "skip_nan": ("sgd", "token", "fp32", 3),
}
POISONED_STEP = 1


def global_batches() -> list[list[dict[str, torch.Tensor]]]:
    """STEPS global batches of GLOBAL samples as a list of sample dicts, identical in every process."""
    generator = torch.Generator().manual_seed(1234)
    steps = []
    for step in range(STEPS):
        ids = torch.randint(0, MODEL.vocab_size, (GLOBAL, CONTEXT), generator=generator)
        labels = ids.clone()
        keep = torch.rand(GLOBAL, CONTEXT, generator=generator)
        # Sample i keeps a fraction of its tokens that grows with i: the first rank holds far fewer.
        for sample in range(GLOBAL):
            labels[sample, keep[sample] > (sample + 1) / GLOBAL] = -100
        if step % 2 == 0:
            labels[0:MICRO] = -100  # a micro-batch with zero loss tokens
        steps.append([{"input_ids": ids[i], "labels": labels[i]} for i in range(GLOBAL)])
    return steps


def rank_micro_batches(samples: list[dict[str, torch.Tensor]], dp_rank: int, dp_size: int) -> list[dict]:
    per_rank = GLOBAL // dp_size
    mine = samples[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [
        {key: torch.stack([s[key] for s in mine[i : i + MICRO]]) for key in ("input_ids", "labels")}
        for i in range(0, per_rank, MICRO)
    ]


def _name(name: str) -> str:
    return name.removeprefix("module.")


def poisonable_loss(output, micro_batch):
    loss = causal_lm_loss(output, micro_batch)
    return loss * micro_batch["poison"] if "poison" in micro_batch else loss


def run_strategy_case(runtime, strategy: str, case: str) -> dict:
    optimizer_name, weighting, precision, steps = CASES[case]
    parallel = ParallelConfig(strategy=strategy, mixed_precision=precision)
    torch.manual_seed(0)
    model = TinyGPT(MODEL).to(runtime.device)
    model = parallelize(model, runtime, parallel)
    lr = 0.1 if optimizer_name == "sgd" else 1e-3
    optimizer = build_optimizer(
        OptimizerConfig(name=optimizer_name, lr=lr, weight_decay=0.1, momentum=0.9), model
    ).optimizer
    first_grads: dict[str, torch.Tensor] = {}

    def capture(opt, args, kwargs):
        if not first_grads:
            for name, param in model.named_parameters():
                first_grads[_name(name)] = gathered(param.grad)

    optimizer.register_step_pre_hook(capture)
    skip_nan = case == "skip_nan"
    step_fn = make_train_step(
        model,
        poisonable_loss if skip_nan else causal_lm_loss,
        optimizer,
        settings=StepSettings(
            max_grad_norm=1.0,
            nonfinite="skip" if skip_nan else "raise",
            loss_weighting=weighting,
            device=runtime.device,
            dp_size=runtime.dp_size,
            dp_group=data_parallel_group(runtime),
            autocast_dtype=autocast_dtype(parallel),
        ),
        grad_scaler=build_grad_scaler(parallel, runtime),
    )
    losses, norms, skipped = [], [], []
    state = TrainState()
    for index, samples in enumerate(global_batches()[:steps]):
        micro_batches = rank_micro_batches(samples, runtime.dp_rank, runtime.dp_size)
        if skip_nan and index == POISONED_STEP and runtime.dp_rank == runtime.dp_size - 1:
            micro_batches[-1]["poison"] = torch.tensor(float("nan"))
        metrics = step_fn(state, micro_batches)
        skipped.append(metrics.get("skipped"))
        loss = metrics["loss"].detach().clone()
        if runtime.distributed:
            dist.all_reduce(loss)  # what the metrics hook does on a logging step: the mean over ranks
            loss /= runtime.dp_size
        losses.append(float(loss))
        norms.append(float(metrics["grad_norm"]))
        state = state.after_step()
    weights = {_name(name): gathered(param) for name, param in model.named_parameters()}
    if runtime.distributed:  # every rank's own view, to check that they agree
        every_rank: list = [None] * runtime.world_size
        dist.all_gather_object(every_rank, (skipped, {n: w.tolist() for n, w in weights.items()}))
    else:
        every_rank = [(skipped, {n: w.tolist() for n, w in weights.items()})]
    return {
        "grads": first_grads,
        "losses": losses,
        "grad_norms": norms,
        "weights": weights,
        "skipped_by_rank": [entry[0] for entry in every_rank],
        "weights_by_rank": [entry[1] for entry in every_rank],
    }


def main(argv: list[str]) -> None:
    strategy, out = argv[0], argv[1]
    cases = argv[2].split(",") if len(argv) > 2 else list(CASES)
    with setup_runtime(RuntimeConfig(device="cpu"), ParallelConfig(strategy=strategy), seed=0) as runtime:
        results = {case: run_strategy_case(runtime, strategy, case) for case in cases}
        results["world_size"] = runtime.world_size
        results["dp_rank_seen"] = runtime.dp_rank
        if runtime.is_main:
            torch.save(results, out)


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
