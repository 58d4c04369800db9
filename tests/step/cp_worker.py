"""Worker for tests/step/test_context_parallel.py: trains the tiny GPT on fixed packed-document batches under
context parallelism and saves what the tests compare (step-1 gradients, per-step losses, final
weights) for one layout.

    python -m tests.step.cp_worker none 1 OUT.pt                                       # the 1-rank reference
    python -m torch.distributed.run --nproc_per_node=2 -m tests.step.cp_worker ddp 2 OUT.pt     # cp 2
    python -m torch.distributed.run --nproc_per_node=4 -m tests.step.cp_worker fsdp2 2 OUT.pt   # cp 2 x dp 2

The step is wired as fntrain.run.build wires it: the cp forward and loss of
`fntrain.step.context_parallel.context_parallel_parts`, dp_size = dp x cp and the (dp x cp) group. Every
sequence packs two or three documents (restarting position ids, a block-diagonal causal mask), a
boundary falls inside each cp slice, and labels are masked unevenly so token weighting matters.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from fntrain.data.packing import document_causal_mask, pack_sequence
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.runtime.groups import context_parallel_mesh, data_parallel_group, gradient_group_size
from fntrain.runtime.parallel import ParallelConfig, parallelize
from fntrain.runtime.setup import RuntimeConfig, setup_runtime
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, default_forward, make_train_step
from fntrain.step.context_parallel import context_parallel_parts
from fntrain.step.optim import OptimizerConfig, build_optimizer
from tests.helpers.workers import gathered

STEPS = 4
GLOBAL = 8
MICRO = 2
CONTEXT = 16
MODEL = ModelConfig(context=CONTEXT, n_layer=2, n_head=4, d_model=32, dropout=0.0)
CASES = {"sgd": ("sgd", "token"), "sgd_mean": ("sgd", "mean"), "adamw": ("adamw", "token")}


def packed_global_batches() -> list[list[dict[str, torch.Tensor]]]:
    """STEPS global batches of GLOBAL packed samples, identical in every process."""
    generator = torch.Generator().manual_seed(1234)
    steps = []
    for step in range(STEPS):
        samples = []
        for index in range(GLOBAL):
            ids = torch.randint(0, MODEL.vocab_size, (CONTEXT,), generator=generator)
            cuts = sorted(torch.randint(2, CONTEXT - 2, (1 + index % 2,), generator=generator).tolist())
            documents = torch.zeros(CONTEXT, dtype=torch.int64)
            for cut in cuts:
                documents[cut:] += 1
            sample = pack_sequence(ids, document_ids=documents)
            keep = torch.rand(CONTEXT, generator=generator) < (index + 1) / GLOBAL
            sample["labels"] = sample["labels"].masked_fill(~keep, -100)
            samples.append(sample)
        if step % 2 == 0:
            for sample in samples[:MICRO]:
                sample["labels"].fill_(-100)  # a micro-batch with zero loss tokens
        steps.append(samples)
    return steps


def packed_rank_micro_batches(samples: list[dict[str, torch.Tensor]], dp_rank: int, dp_size: int) -> list[dict]:
    per_rank = GLOBAL // dp_size
    mine = samples[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    batches = []
    for i in range(0, per_rank, MICRO):
        batch = {key: torch.stack([s[key] for s in mine[i : i + MICRO]]) for key in mine[0]}
        batch["attention_mask"] = document_causal_mask(batch["document_ids"])
        batches.append(batch)
    return batches


def run_cp_case(runtime, strategy: str, cp_size: int, case: str) -> dict:
    optimizer_name, weighting = CASES[case]
    torch.manual_seed(0)
    model = parallelize(TinyGPT(MODEL), runtime, ParallelConfig(strategy=strategy, cp_size=cp_size))
    lr = 0.1 if optimizer_name == "sgd" else 1e-3
    optimizer = build_optimizer(OptimizerConfig(name=optimizer_name, lr=lr, weight_decay=0.1, momentum=0.9), model)
    optimizer = optimizer.optimizer
    first_grads: dict[str, torch.Tensor] = {}

    def capture(opt, args, kwargs):
        if not first_grads:
            first_grads.update({n.removeprefix("module."): gathered(p.grad) for n, p in model.named_parameters()})

    optimizer.register_step_pre_hook(capture)
    forward, loss = default_forward, causal_lm_loss
    extra = {}
    if cp_size > 1:
        parts = context_parallel_parts(forward, loss, mesh=context_parallel_mesh(runtime))
        forward, loss, extra = parts.forward, parts.train_loss, {"loss_context": parts.context}
    step_fn = make_train_step(
        model, loss, optimizer, settings=StepSettings(max_grad_norm=1.0, loss_weighting=weighting, device=runtime.device,
        dp_size=gradient_group_size(runtime), dp_group=data_parallel_group(runtime), **extra), forward=forward,
    )  # fmt: skip
    losses, norms = [], []
    state = TrainState()
    for samples in packed_global_batches():
        metrics = step_fn(state, packed_rank_micro_batches(samples, runtime.dp_rank, runtime.dp_size))
        reported = metrics["loss"].detach().clone()
        if runtime.distributed:
            dist.all_reduce(reported)  # what the metrics hook does: the mean over every rank
            reported /= runtime.world_size
        losses.append(float(reported))
        norms.append(float(metrics["grad_norm"]))
        state = state.after_step()
    weights = {n.removeprefix("module."): gathered(p) for n, p in model.named_parameters()}
    return {"grads": first_grads, "losses": losses, "grad_norms": norms, "weights": weights}


def ring_probe(out: str) -> None:
    """--parallel.cp-style ring on CPU, 2 ranks: the slices torch's head-tail load balancer gives, and
    what the forward meets inside torch's ring dispatcher (CPU attention has no sharding strategy)."""
    from fntrain.step.context_parallel import _ring_shard

    with setup_runtime(RuntimeConfig(device="cpu"), ParallelConfig(strategy="ddp", cp_size=2), seed=0) as runtime:
        mesh = context_parallel_mesh(runtime)
        parts = context_parallel_parts(default_forward, causal_lm_loss, mesh=mesh, style="ring")
        ids = torch.arange(16).view(2, 8)
        micro_batch = {"input_ids": ids, "labels": ids.clone()}
        model = TinyGPT(ModelConfig(context=8, n_layer=1, n_head=2, d_model=8))
        error = ""
        try:
            with parts.context():
                parts.forward(model, micro_batch)
        except NotImplementedError as caught:
            error = str(caught)
        slices = {key: value.tolist() for key, value in _ring_shard(mesh)(micro_batch).items()}
        every: list = [None] * runtime.world_size
        dist.all_gather_object(every, {"slices": slices, "error": error})
        if runtime.is_main:
            torch.save(every, out)


def main(argv: list[str]) -> None:
    if argv[0] == "ring_probe":
        ring_probe(argv[1])
        return
    strategy, cp_size, out = argv[0], int(argv[1]), argv[2]
    cases = argv[3].split(",") if len(argv) > 3 else list(CASES)
    parallel = ParallelConfig(strategy=strategy, cp_size=cp_size)
    with setup_runtime(RuntimeConfig(device="cpu"), parallel, seed=0) as runtime:
        results = {case: run_cp_case(runtime, strategy, cp_size, case) for case in cases}
        results["layout"] = {"world": runtime.world_size, "dp": runtime.dp_size, "cp": runtime.cp_size}
        ranks = [None] * runtime.world_size
        if runtime.distributed:
            dist.all_gather_object(ranks, (runtime.dp_rank, runtime.cp_rank))
        results["coordinates"] = ranks
        if runtime.is_main:
            torch.save(results, out)


if __name__ == "__main__":
    from fntrain.runtime.process import run_main

    run_main(lambda: main(sys.argv[1:]))
