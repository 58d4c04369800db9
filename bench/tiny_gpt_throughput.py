"""Tiny-GPT throughput: the recipe (train() + its default hooks) against a plain-PyTorch script of the
same model, data, optimizer and schedule, logging on the same steps. Interleaved rounds of K steps in
fresh processes, each pinned to one core with torch on one thread; the paired ratio needs no speed
normalisation.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

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
from fntrain import TrainState, train
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
            "(one reduction, a device sync, a log line) and each run's set-up (progress bar, files).",
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
        state = {"state": TrainState()}
        sample = built.data.collate_fn([built.data.dataset[0]] * config.train.micro_batch_size)
        flops = measure_flops_per_token(lambda: recipe.TinyGPT(config.model), sample, loss_fn=causal_lm_loss)

        def fntrain_round() -> int:
            # Each round is a run of `steps` steps with the recipe's hooks, built anew (FLOPs counted once
            # above rather than at every round's TRAIN_BEGIN: a once-per-run cost, not a per-step one).
            plan = dataclasses.replace(built.plan, train_iters=state["state"].global_step + steps)
            inputs = HookInputs(config, runtime, plan, comp, run_dir=built.run_dir, flops_per_token=flops)
            hooks = standard_hooks(inputs)
            state["state"] = train(
                state["state"], step_fn, hooks, data=data_fn(built.data), plan=plan, count_batch=count_batch
            ).state
            return steps

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

        return interleave(
            {"plain": plain_round, "fntrain": fntrain_round}, repeats=repeats,
            targets=[Target("fntrain", "plain", 0.5 * 0.05, ratio=True)], budget_s=budget_s,
            clock=time.process_time,  # CPU seconds of this process (one torch thread, no loader workers)
        )  # fmt: skip
