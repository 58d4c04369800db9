"""P1 loop overhead: `train()` against a hand-written PyTorch loop running the same step on the same data.

Rows: per-step overhead of `train()` with no hooks (goal <= 10 us), of `make_train_step` against a
hand-written step, of the default hooks (progress, metrics every 10 steps, throughput; goal <= 30 us, the
baseline logging on the same steps), and of idle profiler / memory / sampling hooks configured outside their
windows.
When `lightning` is installed (the `bench` extra), the tiny MLP also runs under Lightning Fabric and the
Lightning Trainer, each against the plain hand-written loop, as a reference point.

The goal rows measure in situ: every variant runs the same step object on the same tensors, and what is
compared is the time between consecutive steps of a run (the step itself, and its variation, left out),
in CPU time of this thread, paired round by round, the process pinned to one core (bench/RESULTS.md,
Method). Rows on the MLP and the trivial step are in microseconds at reference speed (scaled by a
pure-Python yardstick timed in the same round); rows on the GPT step, where the loop runs with the caches
the step left and its cost moves with the step's, are a share of the step.
Run: `python -m bench.loop_overhead [--quick]`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bench.harness import (
    Row,
    Target,
    Timing,
    bench_main,
    in_fresh_processes,
    interleave,
    one_core,
    overhead_row,
    quiet,
    share_row,
)
from fntrain import RunPlan, TrainState, train
from fntrain.step import StepSettings, make_train_step

LOG_EVERY = 10
LR = 1e-4
WIDTH = 0.5  # rounds continue until each goal row's interval is narrower than this fraction of its goal
GPT_WIDTH = 5e-4  # ... and each GPT row's until narrower than 0.05% of the step
PROCESSES = 3  # full runs measure in this many fresh processes, one after another
# CPU time of this thread (torch runs on it: one thread): what another process takes is not counted.
CLOCK = time.thread_time


def _mlp_workload(batch_size: int = 32, width: int = 128) -> tuple[torch.nn.Module, list, Callable]:
    """A tiny MLP regression step of about 0.3 ms on one CPU thread."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 1))
    batches = [
        [{"x": torch.randn(batch_size, width), "y": torch.randn(batch_size, 1)}] for _ in range(256)
    ]

    def loss_fn(output: torch.Tensor, micro_batch: dict) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, micro_batch["y"])

    return model, batches, loss_fn


def _gpt_workload() -> tuple[torch.nn.Module, list, Callable]:
    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.step import causal_lm_loss

    torch.manual_seed(0)
    config = ModelConfig(context=64, n_layer=2, n_head=2, d_model=64)
    model = TinyGPT(config)
    batches = []
    for _ in range(32):
        ids = torch.randint(0, 256, (8, 64))
        batches.append([{"input_ids": ids, "labels": ids}])
    return model, batches, causal_lm_loss


def _forward_x(model: torch.nn.Module, micro_batch: dict) -> Any:
    return model(micro_batch["x"])


def _forward_ids(model: torch.nn.Module, micro_batch: dict) -> Any:
    return model(micro_batch["input_ids"])


class _Gaps:
    """Wraps the step: sums the time from the end of one step to the start of the next within a run, which
    is the loop's and the hooks' own per-step time, with the step itself (and its variation) left out and
    the run's set-up and tear-down (once per run, not per step) not counted."""

    def __init__(self) -> None:
        self.total, self.count, self.last_end = 0.0, 0, None

    def reset(self) -> None:
        self.total, self.count, self.last_end = 0.0, 0, None

    def per_step(self) -> float:
        return self.total / max(1, self.count)

    def wrap(self, step_fn: Callable) -> Callable:
        clock = CLOCK

        def step(state, batch):
            started = clock()
            if self.last_end is not None:
                self.total += started - self.last_end
                self.count += 1
            out = step_fn(state, batch)
            self.last_end = clock()
            return out

        return step


def _variants(model, batches, loss_fn, forward, steps: int, hooks_factories: dict[str, Callable[[], list]]):
    """Every variant runs the same step object on the same tensors; each returns (steps, the mean time
    between consecutive steps), so `Timing.outside` is the loop's (and the hooks') own time per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    library_step = make_train_step(model, loss_fn, optimizer, settings=StepSettings(loss_weighting="mean"), forward=forward)
    gaps = _Gaps()
    step_fn = gaps.wrap(library_step)
    epoch_len = len(batches)
    plan = RunPlan(train_iters=steps, steps_per_epoch=epoch_len, epochs=-(-steps // epoch_len))
    state0 = TrainState()

    def data(epoch: int, cursor: int):
        return iter(batches[cursor:])

    def bare_step(state, batch):
        micro_batch = batch[0]
        loss = loss_fn(forward(model, micro_batch), micro_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    handwritten_step = gaps.wrap(bare_step)

    def measured(loop: Callable[[], None]) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            gaps.reset()
            loop()
            return steps, gaps.per_step()

        return run

    def plain_loop() -> None:
        done = 0
        while done < steps:
            for batch in batches[: steps - done]:
                step_fn(state0, batch)
                done += 1

    def plain_loop_handwritten_step() -> None:
        done = 0
        while done < steps:
            for batch in batches[: steps - done]:
                handwritten_step(state0, batch)
                done += 1

    log_file = open(os.devnull, "w")  # noqa: SIM115 - the baseline's metrics file, kept for the run
    plain_log = logging.getLogger("bench.plain")

    def plain_loop_logging() -> None:
        """The plain loop logging on the same steps as the metrics hook: a read, a line, a JSON record."""
        done = 0
        while done < steps:
            for batch in batches[: steps - done]:
                metrics = step_fn(state0, batch)
                done += 1
                if done % LOG_EVERY == 0:
                    loss = float(metrics["loss"])
                    plain_log.info("step=%d loss=%.9g", done, loss)
                    log_file.write(json.dumps({"step": done, "loss": loss}) + "\n")

    def with_train(hooks_factory: Callable[[], list]) -> Callable[[], None]:
        def run() -> None:
            train(state0, step_fn, hooks_factory(), data=data, plan=plan)

        return run

    variants = {
        "plain loop": measured(plain_loop),
        "plain loop, logging every 10": measured(plain_loop_logging),
        "plain loop, hand-written step": measured(plain_loop_handwritten_step),
        "train(), no hooks": measured(with_train(lambda: [])),
    }
    for name, factory in hooks_factories.items():
        variants[f"train(), {name}"] = measured(with_train(factory))
    return variants


def _lightning_variants(model, batches, loss_fn, forward, steps: int, run_dir: str) -> dict[str, Callable]:
    """Lightning Fabric and the Lightning Trainer running the hand-written step; empty without `lightning`.

    Each gets its own deep copy of `model` and its own SGD optimizer (same learning rate) so the variants
    do not share parameters or optimizer state. The Trainer is built inside each run, as a user would build
    it per fit; its set-up is amortised over the long runs of the full mode.
    """
    try:
        import lightning
    except ImportError:
        return {}
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Advice aimed at real training jobs (loader workers, logging interval), not at a timing loop.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*number of training batches.*logging interval.*")
    # torch's pytree deprecation, raised from inside Lightning's own code.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")

    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    fabric_model = copy.deepcopy(model)
    fabric_model, fabric_optimizer = fabric.setup(fabric_model, torch.optim.SGD(fabric_model.parameters(), lr=LR))

    def fabric_loop() -> int:
        done = 0
        while done < steps:
            for batch in batches[: steps - done]:
                micro_batch = batch[0]
                loss = loss_fn(forward(fabric_model, micro_batch), micro_batch)
                fabric.backward(loss)
                fabric_optimizer.step()
                fabric_optimizer.zero_grad(set_to_none=True)
                done += 1
        return steps

    class StepModule(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(model)

        def training_step(self, batch, batch_idx):
            micro_batch = batch[0]
            return loss_fn(forward(self.net, micro_batch), micro_batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = StepModule()
    # batch_size=None: each item of `batches` is already one collated batch, as the other variants see it.
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)

    def trainer_fit() -> int:
        trainer = lightning.Trainer(
            accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=run_dir,
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=loader)
        return steps

    return {"Lightning Fabric": fabric_loop, "Lightning Trainer": trainer_fit}


def _default_hooks(steps: int, run_dir: str) -> Callable[[], list]:
    """Progress bar, metrics every 10 steps (log line + metrics.jsonl) and throughput, as recipes use them."""
    from fntrain.hooks.metrics import MetricsConfig, metrics_hook
    from fntrain.hooks.metrics_log import metrics_log
    from fntrain.hooks.progress import ProgressConfig, progress_hook
    from fntrain.hooks.throughput import ThroughputConfig, throughput_meter
    from fntrain.runtime import Runtime

    runtime = Runtime()
    bar_file = open(os.devnull, "w")  # noqa: SIM115 - the bar is drawn (and paid for), but not into the table

    def factory() -> list:
        writer = metrics_log(MetricsConfig(), runtime, run_dir)
        meter = throughput_meter(ThroughputConfig(), runtime)
        return [
            meter.hook,
            metrics_hook(
                runtime, log_every=LOG_EVERY, writer=writer, sources=(meter.figures,), last_step=steps
            ),
            progress_hook(ProgressConfig(), runtime, total=steps, latest=writer.latest, file=bar_file),
        ]

    return factory


def _idle_window_hooks() -> dict[str, Callable[[], list]]:
    """Profiler and memory hooks configured with windows that never open in the benchmark."""
    factories: dict[str, Callable[[], list]] = {}
    from fntrain.runtime import Runtime

    runtime = Runtime()
    try:
        from fntrain.hooks.profiler import ProfilerConfig, profiler_hook

        config = ProfilerConfig(enabled=True, start_step=10**8, stop_step=10**8 + 1)
        factories["idle profiler"] = lambda: [profiler_hook(config, runtime)]
    except ImportError:
        pass
    try:
        from fntrain.hooks.memory import MemoryConfig, memory_hook

        config_mem = MemoryConfig(mem_info=False)
        factories["memory hook (disabled)"] = lambda: [memory_hook(config_mem, runtime)]
    except ImportError:
        pass
    from fntrain.hooks.sample import SampleConfig, sample_hook

    config_sample = SampleConfig(every=10**8, prompts=("x",), at_end=False)  # between two samples
    factories["sampling hook (between samples)"] = lambda: [
        sample_hook(config_sample, lambda *_: "", torch.nn.Linear(1, 1), runtime, tempfile.gettempdir())
    ]
    return factories


def measure_trivial(repeats: int, budget_s: float) -> Timing:
    """The loop's and the default hooks' own per-step cost, with a trivial step (a ready metrics dict
    holding a 0-d tensor): what remains when the step's own time and its run-to-run variation are gone."""
    with one_core():
        quiet()
        return _trivial_timing(2000, repeats, budget_s, tempfile.mkdtemp(prefix="fntrain-bench-"))


def _trivial_timing(steps: int, repeats: int, budget_s: float, run_dir: str) -> Timing:
    metrics = {"loss": torch.tensor(1.0), "grad_norm": 0.0, "lr": LR}
    batches = [[{"x": torch.zeros(1)}]] * steps
    plan = RunPlan(train_iters=steps, steps_per_epoch=steps, epochs=1)
    state0 = TrainState()
    log_file = open(os.devnull, "w")  # noqa: SIM115 - the baseline's metrics file, kept for the run
    plain_log = logging.getLogger("bench.plain")

    def step_fn(state: TrainState, batch: Any) -> dict:
        return metrics

    def plain_loop() -> int:
        for batch in batches:
            step_fn(state0, batch)
        return steps

    def plain_loop_logging() -> int:
        for done, batch in enumerate(batches, start=1):
            out = step_fn(state0, batch)
            if done % LOG_EVERY == 0:
                loss = float(out["loss"])
                plain_log.info("step=%d loss=%.9g", done, loss)
                log_file.write(json.dumps({"step": done, "loss": loss}) + "\n")
        return steps

    default_hooks = _default_hooks(steps, run_dir)

    def with_hooks(factory: Callable[[], list]) -> Callable[[], int]:
        def run_train() -> int:
            train(state0, step_fn, factory(), data=lambda epoch, cursor: iter(batches[cursor:]), plan=plan)
            return steps

        return run_train

    return interleave(
        {
            "plain loop": plain_loop,
            "plain loop, logging every 10": plain_loop_logging,
            "train(), no hooks": with_hooks(lambda: []),
            "train(), default hooks": with_hooks(default_hooks),
        },
        repeats=repeats,
        targets=[
            Target("train(), no hooks", "plain loop", WIDTH * 10e-6, speed=True),
            Target("train(), default hooks", "plain loop, logging every 10", WIDTH * 30e-6, speed=True),
        ],
        budget_s=budget_s,
        clock=CLOCK,
        with_yardstick=True,
    )


def _trivial_rows(timing: Timing) -> list[Row]:
    return [
        overhead_row(
            "P1 loop alone (trivial step): train(), no hooks vs plain loop", timing, "train(), no hooks",
            "plain loop", goal_us=10, speed=True,
            note="the loop's own Python per step, free of the step's variation.",
        ),
        overhead_row(
            "P1 hooks alone (trivial step): train(), default hooks vs plain loop logging on the same steps",
            timing, "train(), default hooks", "plain loop, logging every 10", goal_us=30, speed=True,
            note="the default hooks' own per-step cost, logging steps included, free of the step's variation.",
        ),
    ]  # fmt: skip


def run(quick: bool = False) -> list[Row]:
    """Every row. Full runs measure in PROCESSES fresh processes one after another (the budgets split
    between them) so that what is fixed for a process's life shows in the intervals; quick runs in this one.
    Long runs amortise per-run set-up (a progress bar, a metrics file, a profiler import at TRAIN_BEGIN):
    the goals are per-step costs."""
    processes, steps, repeats = (1, 20, 3) if quick else (PROCESSES, 200, 15 // PROCESSES)
    budget = (lambda seconds: 0.0) if quick else (lambda seconds: seconds / PROCESSES)
    mlp = in_fresh_processes(measure_mlp, processes, steps=steps, repeats=repeats, budget_s=budget(90))
    gpt = in_fresh_processes(measure_gpt, processes, steps=steps // 10, repeats=repeats, budget_s=budget(90))
    trivial = in_fresh_processes(
        measure_trivial, processes, repeats=3 if quick else 30 // PROCESSES, budget_s=budget(30)
    )
    return _mlp_rows(mlp) + _gpt_rows(gpt) + _trivial_rows(trivial)


def measure_mlp(steps: int, repeats: int, budget_s: float) -> Timing:
    """The tiny MLP's variants (Lightning's too, when installed), interleaved, with the yardstick."""
    with one_core():
        quiet()
        run_dir = tempfile.mkdtemp(prefix="fntrain-bench-")
        model, batches, loss_fn = _mlp_workload()
        hooks = _idle_window_hooks()
        hooks["default hooks"] = _default_hooks(steps, run_dir)
        variants = _variants(model, batches, loss_fn, _forward_x, steps, hooks)
        variants.update(_lightning_variants(model, batches, loss_fn, _forward_x, steps, run_dir))
        targets = [
            Target("train(), no hooks", "plain loop", WIDTH * 10e-6, outside=True, speed=True),
            Target("train(), default hooks", "plain loop, logging every 10", WIDTH * 30e-6, outside=True,
                   speed=True),
        ] + [
            Target(f"train(), {name}", "train(), no hooks", WIDTH * 5e-6, outside=True, speed=True)
            for name in IDLE_HOOKS if name in hooks
        ]  # fmt: skip
        return interleave(
            variants, repeats=repeats, targets=targets, budget_s=budget_s, clock=CLOCK, with_yardstick=True
        )


def _mlp_rows(timing: Timing) -> list[Row]:
    """The tiny MLP's rows in microseconds at reference speed: its steps and the loop are Python-bound."""
    rows = [
        overhead_row(
            "P1 tiny MLP: train(), no hooks vs plain loop", timing, "train(), no hooks", "plain loop",
            goal_us=10, outside=True, speed=True, note=LOOP_NOTE,
        ),
        overhead_row(
            "P1 tiny MLP: make_train_step vs hand-written step", timing, "plain loop",
            "plain loop, hand-written step", goal_us=None, speed=True, note=STEP_NOTE,
        ),
        overhead_row(
            "P1 tiny MLP: train(), default hooks vs plain loop logging on the same steps", timing,
            "train(), default hooks", "plain loop, logging every 10", goal_us=30, outside=True, speed=True,
            note=HOOKS_NOTE,
        ),
    ]  # fmt: skip
    rows += [
        overhead_row(
            f"P1 tiny MLP: train(), {name} vs no hooks", timing, f"train(), {name}", "train(), no hooks",
            goal_us=5, outside=True, speed=True, note=IDLE_HOOK_NOTE,
        )
        for name in IDLE_HOOKS if f"train(), {name}" in timing.samples
    ]  # fmt: skip
    rows += [
        overhead_row(
            f"P1 tiny MLP: {name} vs plain loop (hand-written step)", timing, name,
            "plain loop, hand-written step", goal_us=None, speed=True, note=note,
        )
        for name, note in LIGHTNING_NOTES.items() if name in timing.samples
    ]  # fmt: skip
    return rows


def measure_gpt(steps: int, repeats: int, budget_s: float) -> Timing:
    """The tiny GPT's variants, interleaved."""
    with one_core():
        quiet()
        model, batches, loss_fn = _gpt_workload()
        hooks = {"default hooks": _default_hooks(steps, tempfile.mkdtemp(prefix="fntrain-bench-"))}
        variants = _variants(model, batches, loss_fn, _forward_ids, steps, hooks)
        targets = [
            Target("train(), no hooks", "plain loop", GPT_WIDTH, outside=True, share=True),
            Target("train(), default hooks", "plain loop, logging every 10", GPT_WIDTH, outside=True, share=True),
        ]
        return interleave(variants, repeats=repeats, targets=targets, budget_s=budget_s, clock=CLOCK)


def _gpt_rows(timing: Timing) -> list[Row]:
    """The tiny GPT's rows as a share of its step: between 10 ms steps the loop's Python runs with the caches
    the step left, so its microseconds move with the machine's memory load as the step's own do."""
    return [
        share_row(
            "P1 tiny GPT: train(), no hooks vs plain loop", timing, "train(), no hooks", "plain loop",
            goal_percent=None, outside=True, note=LOOP_NOTE,
        ),
        share_row(
            "P1 tiny GPT: make_train_step vs hand-written step", timing, "plain loop",
            "plain loop, hand-written step", goal_percent=None, note=STEP_NOTE,
        ),
        share_row(
            "P1 tiny GPT: train(), default hooks vs plain loop logging on the same steps", timing,
            "train(), default hooks", "plain loop, logging every 10", goal_percent=None, outside=True,
            note=HOOKS_NOTE,
        ),
    ]  # fmt: skip


LOOP_NOTE = "the loop's own Python work per step (two event dispatches, one state and one StepInfo)."
STEP_NOTE = "token/loss bookkeeping and the finite check the library step does and a bare step skips."
HOOKS_NOTE = (
    "progress bar, metrics every 10 steps (one reduction, a log line, a JSON record) and throughput; "
    "non-logging steps do a few integer operations per hook."
)
IDLE_HOOK_NOTE = "a hook outside its window costs a call and an integer comparison."
IDLE_HOOKS = ("idle profiler", "memory hook (disabled)", "sampling hook (between samples)")
LIGHTNING_NOTES = {
    "Lightning Fabric": "Fabric's module/optimizer wrappers and backward dispatch around the same step, "
    "a reference point for a thin launcher.",
    "Lightning Trainer": "the Trainer's loop, hooks, batch transfer, optimizer closure and per-epoch "
    "loader reset around the same step (automatic optimization), a reference point for a full trainer.",
}


if __name__ == "__main__":
    bench_main(run, "Loop overhead", __doc__)
