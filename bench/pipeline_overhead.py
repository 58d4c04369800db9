"""Pipeline step overhead: fntrain's `make_pipeline_step` against a hand-written torch.distributed.pipelining
loop over the same stage, in 2 processes (torchrun, gloo, CPU, one torch thread each).

`python -m bench.pipeline_overhead [--quick] [--json FILE]` launches itself under
`python -m torch.distributed.run --standalone --nproc_per_node=2`; each rank builds the tiny GPT (d_model
128, 4 blocks, context 128; recipes/tiny_gpt.py), cuts it to its stage with the recipe's PIPELINE split
and, in the same processes, alternates per round between three variants of K optimizer steps on the same
fixed batch (4 micro-batches of 4 sequences; each variant has its own copy of the stage and its own AdamW):

- `fntrain`: `make_pipeline_step` (1F1B, 4 micro-batches, max_grad_norm 1.0, token-weighted loss);
- `plain`: what a user writing torch pipelining by hand would do: a `PipelineStage` and
  `Schedule1F1B(stage, 4, loss_fn=mean cross-entropy, scale_grads=True)`, `schedule.step(input_ids,
  target=labels)`, `clip_grad_norm_` over this stage's parameters, `optimizer.step()`, `zero_grad()`;
- `plain_tied`: the hand loop plus what it leaves out and fntrain does, written by hand: the tied
  embedding/head gradient summed across the two stages (one all_reduce), the gradient norm over both
  stages (one all_reduce) for clipping, and the step's loss summed over the pipeline (one all_reduce).

`plain` is NOT the same computation: the tiny GPT ties its output head to its token embedding, which
lands on both stages, and the hand loop neither adds the two copies' gradients (so they drift apart)
nor clips by the global norm. The model is kept as the recipe has it; `plain_tied` is the like-for-like
baseline (after 3 steps its parameters equal fntrain's bitwise on both ranks), `plain` the "what people
write" one. With every token valid, fntrain's token weights are the 1/4 that `scale_grads=True` applies.

Each variant's round ends with a barrier (inside its timing, paid alike by all), so the next variant
starts on both ranks together and a round's time is the pipeline's, not one rank's share; rank 0 keeps,
per round, the slower rank's time. Rounds are wall time: a pipeline's ranks wait on each other, and the
wait is part of the step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import fntrain  # noqa: F401  (before torch: sets OMP_WAIT_POLICY=PASSIVE like the recipe's workers)
from bench.harness import Row, Timing, bench_main, bootstrap_median, interleave, paired_ratio_row, quiet

STAGES = 2
MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 4
GOAL_RATIO = 1.05
VARIANTS = ("plain", "plain_tied", "fntrain")
# Full runs: at least MIN_ROUNDS rounds of STEPS steps per variant, then chunks of CHUNK rounds until the
# fntrain/plain_tied ratio's interval is narrower than WIDTH (half the goal's 5%) or BUDGET_S is spent.
FULL = {"steps": 2, "min_rounds": 12, "max_rounds": 60, "budget_s": 80.0}
QUICK = {"steps": 1, "min_rounds": 2, "max_rounds": 2, "budget_s": 0.0}
CHUNK = 2  # rounds per chunk: the harness rotates the variants' order within a chunk
WIDTH = 0.025


def run(quick: bool = False) -> list[Row]:
    """Launch the 2-rank measurement under torchrun and turn rank 0's rounds into the table's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timing.json"
        subprocess.run(launch_command(quick, out), cwd=Path(__file__).resolve().parent.parent,
                       env=worker_env(os.environ), check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        record = json.loads(out.read_text())
    return rows(Timing(record["samples"], record["samples"]), record["steps"])


def launch_command(quick: bool, out: Path) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) running this module's worker on STAGES ranks."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={STAGES}",
        "-m", "bench.pipeline_overhead", "--worker", str(out), *(["--quick"] if quick else []),
    ]  # fmt: skip


def worker_env(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The workers' environment: one OpenMP thread each (two ranks on two cores), quiet torchrun."""
    return {**environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def rows(timing: Timing, steps: int) -> list[Row]:
    size = f"{STAGES} stages, 1F1B, {MICRO_BATCHES} micro-batches of {MICRO_BATCH_SIZE}x128, gloo on CPU"
    return [
        paired_ratio_row(
            f"Pipeline step ({size}): make_pipeline_step vs hand-written schedule loop", timing, "fntrain",
            "plain", goal_ratio=GOAL_RATIO, unit="ms",
            note="the hand loop clips each stage by its own norm and leaves the tied embedding/head copies "
            "apart (3 fewer all_reduces per step); not the same computation, see the next row.",
        ),
        paired_ratio_row(
            f"Pipeline step ({size}): make_pipeline_step vs hand loop + tied-grad sum, global norm, loss "
            "all_reduce", timing, "fntrain", "plain_tied", goal_ratio=GOAL_RATIO, unit="ms",
            note="like for like: the difference is fntrain's own bookkeeping (token weights, per-micro-batch "
            f"loss records, checks); {steps} steps per variant per round, slower rank's wall time.",
        ),
        paired_ratio_row(
            f"Pipeline step ({size}): the 3 extra all_reduces by hand vs hand loop", timing, "plain_tied",
            "plain", goal_ratio=None, unit="ms",
            note="what summing the tied weight's gradients and the global norm cost on gloo, for scale.",
        ),
    ]  # fmt: skip


def keep_going(ratios: Sequence[float], *, min_rounds: int, max_rounds: int, elapsed_s: float,
               budget_s: float, width: float = WIDTH) -> bool:  # fmt: skip
    """Whether to run another chunk of rounds: always below `min_rounds`, never at `max_rounds` or past
    the budget, otherwise while the ratios' bootstrap interval is wider than `width`."""
    if len(ratios) < min_rounds:
        return True
    if len(ratios) >= max_rounds or elapsed_s >= budget_s:
        return False
    return bootstrap_median(ratios, resamples=500).width > width


def slower_rank(per_rank: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per variant and round, the slowest rank's time: the pipeline's step is done when every stage is."""
    return {name: [max(values) for values in zip(*(rank[name] for rank in per_rank), strict=True)]
            for name in per_rank[0]}  # fmt: skip


def rounds_on_every_rank(variants: dict[str, Callable[[], Any]], settings: dict[str, Any],
                         judged: tuple[str, str], chunk: int) -> dict[str, list[float]]:  # fmt: skip
    """Interleaved rounds of `variants` on every rank, in chunks, until `keep_going` on the ratio
    `judged[0] / judged[1]` of the slowest rank's times says stop (rank 0 decides, so every rank runs the
    same rounds); the slowest rank's samples per variant. A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    mine: dict[str, list[float]] = {name: [] for name in variants}
    started = time.perf_counter()
    while True:
        times = interleave(variants, repeats=chunk, warmup=0, max_repeats=chunk)
        for name in variants:
            mine[name].extend(times.samples[name])
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        combined = slower_rank(gathered)
        ratios = [a / b for a, b in zip(combined[judged[0]], combined[judged[1]], strict=True)]
        go = torch.tensor([keep_going(ratios, min_rounds=settings["min_rounds"], max_rounds=settings["max_rounds"],
                                      elapsed_s=time.perf_counter() - started, budget_s=settings["budget_s"])])  # fmt: skip
        dist.broadcast(go, src=0)
        if not bool(go):
            return combined


# ----------------------------------------------------------------------------- the workers (under torchrun)


def _pin_to_own_core(local_rank: int) -> None:
    """One core per rank, before the process group starts its threads (they inherit the affinity)."""
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) >= STAGES:
            os.sched_setaffinity(0, {allowed[local_rank % len(allowed)]})


def _stage(rank: int):
    import torch

    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.runtime.pipeline import split_stage, stage_ties
    from recipes.tiny_gpt import PIPELINE

    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=128, n_layer=4, n_head=4, d_model=128))
    ties = stage_ties(model, PIPELINE, STAGES)
    return split_stage(model, PIPELINE, stage=rank, stages=STAGES), ties


def _batch() -> list[dict]:
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (MICRO_BATCH_SIZE, 128), generator=generator) for _ in range(MICRO_BATCHES)]
    return [{"input_ids": x, "labels": x} for x in ids]


def _fntrain_step(rank: int, group) -> Callable[[], None]:
    import torch

    from fntrain.state import TrainState
    from fntrain.step import StepSettings, causal_lm_loss
    from fntrain.step.pipeline import PipelineLayout, make_pipeline_step

    model, ties = _stage(rank)
    here = tuple((holders[rank], group) for holders in ties if rank in holders)
    counted = tuple(rank == min(holders) for holders in ties if rank in holders)
    layout = PipelineLayout(rank, STAGES, group, "1f1b", here, counted)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_pipeline_step(model, causal_lm_loss, [optimizer], [], layout,
                                 settings=StepSettings(max_grad_norm=1.0, device=torch.device("cpu")),
                                 micro_batches=MICRO_BATCHES)  # fmt: skip
    batch, state = _batch(), TrainState()
    return lambda: step_fn(state, batch)


def _plain_step(rank: int, group, *, tied: bool) -> Callable[[], None]:
    """The hand-written loop; `tied`: plus the tied-gradient sum, the global norm and the loss all_reduce."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model, ties = _stage(rank)
    first, last = rank == 0, rank == STAGES - 1

    def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1))

    stage = PipelineStage(model, rank, STAGES, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=mean_cross_entropy, scale_grads=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    tied_params = [model.get_parameter(holders[rank]) for holders in ties if rank in holders]
    # The tied copy is counted once in the global norm: by the first stage that holds it.
    untied = [p for p in params if all(p is not t for t in tied_params)]
    counted_ties = [model.get_parameter(h[rank]) for h in ties if rank in h and rank == min(h)]
    micro = _batch()
    input_ids = torch.cat([mb["input_ids"] for mb in micro])
    labels = torch.cat([mb["labels"] for mb in micro])

    def step() -> None:
        losses: list[torch.Tensor] = []
        schedule.step(*((input_ids,) if first else ()), target=labels if last else None,
                      losses=losses if last else None)  # fmt: skip
        if not tied:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            loss = torch.stack(losses).mean() if last else torch.zeros(())
            dist.all_reduce(loss, group=group)
            for param in tied_params:
                dist.all_reduce(param.grad, group=group)
            local = torch.nn.utils.get_total_norm([p.grad for p in untied + counted_ties]) ** 2
            dist.all_reduce(local, group=group)
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, local.sqrt())
        optimizer.step()
        optimizer.zero_grad()

    return step


def _worker(out: str, quick: bool) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    _pin_to_own_core(local_rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    quiet()
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD
    settings = QUICK if quick else FULL
    steps = settings["steps"]
    steppers = {"plain": _plain_step(rank, group, tied=False), "plain_tied": _plain_step(rank, group, tied=True),
                "fntrain": _fntrain_step(rank, group)}  # fmt: skip

    def variant(step: Callable[[], None]) -> Callable[[], int]:
        def round_() -> int:
            for _ in range(steps):
                step()
            dist.barrier(group)  # the next variant starts on both ranks together
            return steps

        return round_

    variants = {name: variant(steppers[name]) for name in VARIANTS}
    for name in VARIANTS:  # warm-up: shape inference, AdamW's state, first-touch allocations
        variants[name]()
    combined = rounds_on_every_rank(variants, settings, ("fntrain", "plain_tied"), chunk=CHUNK)
    if rank == 0:
        Path(out).write_text(json.dumps({"samples": combined, "steps": steps}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    bench_main(run, "Pipeline step overhead", __doc__, worker=_worker)


if __name__ == "__main__":
    main()
