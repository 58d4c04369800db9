"""Tiny-GPT throughput: the recipe (train() + its default hooks) against a plain-PyTorch script of the
same model, data, optimizer and schedule, logging on the same steps. Interleaved rounds of K steps in
fresh processes, each pinned to one core with torch on one thread; the paired ratio needs no speed
normalisation. The recipe's rounds are stretches of one run, as the plain script's are of one loop: a
run's set-up (hooks, files, the epoch's order) is paid once, as in a user's run, not once per round.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.harness import (
    Row,
    Target,
    Timing,
    in_fresh_processes,
    interleave,
    one_core,
    paired_ratio_row,
    quiet,
)
from fntrain import Event, Hook, StopTraining, TrainState, train
from fntrain.data.pipeline import data_fn
from fntrain.data.tokens import count_batch
from fntrain.hooks.standard import HookInputs, standard_hooks
from fntrain.models.flops import measure_flops_per_token
from fntrain.step import StepSettings, causal_lm_loss, make_train_step

LOG_EVERY = 10
PROCESSES = 3  # full runs measure in this many fresh processes, one after another


def _config(run_dir: str):
    from fntrain.models.gpt import ModelConfig
    from fntrain.run.config import CheckpointConfig, TrainConfig
    from recipes.tiny_gpt import Config

    # The recipe's hooks as a run has them, less checkpoint saving, which the plain script does not do
    # either (the recipe's default saves every 100 steps; the checkpoint benchmarks time saves).
    return Config(
        run_dir=run_dir,
        log_every=LOG_EVERY,
        model=ModelConfig(context=64, n_layer=2, n_head=2, d_model=64),
        train=TrainConfig(train_iters=10_000, global_batch_size=16, micro_batch_size=8),
        checkpoint=CheckpointConfig(save_every=0, restore_from="none"),
    )


def run(quick: bool = False) -> list[Row]:
    """The throughput row: full runs measure in PROCESSES fresh processes one after another (the budget split
    between them), quick runs in this one."""
    if quick:
        timing = measure(steps=10, repeats=2, budget_s=0.0)
    else:
        timing = in_fresh_processes(measure, PROCESSES, steps=20, repeats=5, budget_s=120 / PROCESSES)
    model, batch = _config("").model, _config("").train.global_batch_size
    return [
        paired_ratio_row(
            "Tiny-GPT throughput: recipe (train + default hooks) vs plain script (tokens/s ratio)",
            timing, "fntrain", "plain", goal_ratio=0.95, unit="tokens/s", rate=batch * model.context,
            higher_is_better=True,
            note="the step dominates; the rest is token counting and weighting, the hooks' logging steps "
            "(one reduction, a device sync, a log line) and the collation of labels beside the inputs.",
        )  # fmt: skip
    ]


def measure(steps: int, repeats: int, budget_s: float) -> Timing:
    """Rounds of `steps` steps of the recipe and of the plain script, interleaved, this process on one core
    and torch on one thread."""
    with one_core():
        quiet()
        return _timing(steps, repeats, budget_s)


def _timing(steps: int, repeats: int, budget_s: float) -> Timing:
    import recipes.tiny_gpt as recipe
    from fntrain.run.build import build_job
    from fntrain.run.checks import check_run
    from fntrain.runtime import Runtime

    with tempfile.TemporaryDirectory() as tmp:
        config = _config(tmp)
        # The plain script does not evaluate: neither does the measured recipe.
        config = dataclasses.replace(
            config, evaluate=dataclasses.replace(config.evaluate, eval_every=0, eval_epochs=0, at_end=False),
            progress=dataclasses.replace(config.progress, enabled=False),  # no bar into the table
        )
        runtime = Runtime()
        checked = check_run(config, recipe.spec)  # phase 1: the data read once, the plan
        built = build_job(config, recipe.spec, runtime, checked)
        comp = built.components
        step_fn = make_train_step(
            comp.model, comp.loss_fn, comp.optimizers, comp.schedulers, settings=StepSettings(max_grad_norm=1.0)
        )
        sample = built.data.collate_fn([built.data.dataset[0]] * config.train.micro_batch_size)
        flops = measure_flops_per_token(lambda: recipe.TinyGPT(config.model), sample, loss_fn=causal_lm_loss)
        inputs = HookInputs(config, runtime, built.plan, comp, run_dir=built.run_dir, flops_per_token=flops)

        def whole_run(park: Hook) -> None:
            # One run of the recipe's hooks (FLOPs counted once above rather than at TRAIN_BEGIN), long
            # enough for every round; `park` holds it between rounds.
            train(TrainState(), step_fn, [*standard_hooks(inputs), park], data=data_fn(built.data),
                  plan=built.plan, count_batch=count_batch)  # fmt: skip

        fntrain_round, end_run = _rounds_of_one_run(whole_run, steps)
        # The plain script: its own copy of the model, optimizer and schedule, same data order and shapes.
        plain = build_job(config, recipe.spec, runtime, checked)
        model = plain.components.model
        optimizer, scheduler = plain.components.optimizers[0], plain.components.schedulers[0]
        dataset = plain.data.dataset
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
        position = {"index": 0, "step": 0}
        micro, per_step = config.train.micro_batch_size, config.train.global_batch_size

        def plain_round() -> int:
            for _ in range(steps):
                start = position["index"] % (len(order) - per_step)
                position["index"] += per_step
                total = 0.0
                for m in range(0, per_step, micro):
                    samples = [dataset[i] for i in order[start + m : start + m + micro]]
                    ids = torch.stack([s["input_ids"] for s in samples])
                    loss = causal_lm_loss(model(ids), {"labels": ids}) / (per_step // micro)
                    loss.backward()
                    total = total + loss.detach()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                position["step"] += 1
                if position["step"] % LOG_EVERY == 0:
                    float(total)  # the plain script logs on the same steps
            return steps

        try:
            return interleave(
                {"plain": plain_round, "fntrain": fntrain_round}, repeats=repeats,
                targets=[Target("fntrain", "plain", 0.5 * 0.05, ratio=True)], budget_s=budget_s,
                clock=time.process_time,  # CPU seconds of this process: the parked thread uses none
            )  # fmt: skip
        finally:
            end_run()


def _rounds_of_one_run(
    start_run: Callable[[Hook], None], steps: int
) -> tuple[Callable[[], int], Callable[[], None]]:
    """(round, end) for a run that goes on for every round, as a user's run does: its set-up (hooks, data
    order, files) is paid once, not once per round. `start_run(park)` runs on a thread of its own; the
    `park` hook holds it at TRAIN_BEGIN and after every `steps` steps until `round()` lets it go for the
    next `steps` steps (and returns `steps` when they are done); `end()` stops the run and joins it."""
    go, parked = threading.Semaphore(0), threading.Semaphore(0)
    stop = threading.Event()

    def park(event: Event, state: TrainState, info: Any) -> None:
        if event is Event.TRAIN_BEGIN or (event is Event.STEP_END and state.global_step % steps == 0):
            parked.release()
            go.acquire()
            if stop.is_set():
                raise StopTraining("benchmark over")

    def run() -> None:
        try:
            start_run(park)
        finally:
            parked.release()  # never leave a round or end() waiting on a run that has ended

    thread = threading.Thread(target=run, name="fntrain-run", daemon=True)
    thread.start()
    parked.acquire()  # set up and parked at TRAIN_BEGIN: nothing timed yet

    def one_round() -> int:
        go.release()
        parked.acquire()
        if not thread.is_alive():
            raise RuntimeError("the measured run ended before the benchmark did")
        return steps

    def end() -> None:
        stop.set()
        go.release()
        thread.join()

    return one_round, end
