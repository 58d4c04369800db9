"""The standard hook list: built from one factory per hook, in [S27] order; a factory of a hook that is
off returns None; every standard hook survives an ABORT before or right after TRAIN_BEGIN."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from fntrain.hooks import progress as progress_module
from fntrain.hooks import standard
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.gc import GCConfig
from fntrain.hooks.memory import MemoryConfig
from fntrain.hooks.profiler import ProfilerConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.sample import SampleConfig
from fntrain.hooks.standard import HookInputs, make_wiring, wire_standard_hooks
from fntrain.hooks.throughput import ThroughputConfig
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig, JobConfig
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.watchdog import WatchdogConfig
from fntrain.state import RunPlan
from fntrain.stateful import StatefulHook
from tests.checkpoint import toy
from tests.hooks.drive import drive


def sections(run_dir: Path, **fields) -> JobConfig:
    """A job config carrying the hook sections `standard_hooks` reads, logging every step."""
    return JobConfig(run_dir=str(run_dir), log_every=1, **fields)


def every_hook_on(run_dir: Path) -> JobConfig:
    """Each standard hook on, each holding what it can hold on cpu once TRAIN_BEGIN ran: a metrics file
    to open, a bar and its logging redirection, automatic gc turned off, a profiler session, signal
    handlers, a watchdog thread."""
    return sections(
        run_dir,
        memory=MemoryConfig(mem_info=True, save_path=str(run_dir / "memory")),
        progress=ProgressConfig(redirect_logging=True),
        evaluate=EvaluateConfig(eval_every=1),
        sample=SampleConfig(every=1, prompts=("x",)),
        gc=GCConfig(gc_every=1, disable_automatic=True),
        profiler=ProfilerConfig(enabled=True, start_on_init=True, output_path=str(run_dir / "profile")),
        checkpoint=CheckpointConfig(save_every=1, save_on_interrupt=True, preempt_signals=("SIGTERM",)),
    )


def inputs_for(config: JobConfig, **fields) -> HookInputs:
    samples = [torch.zeros(6, dtype=torch.long) for _ in range(3)]
    return HookInputs(
        config, Runtime(), RunPlan(train_iters=4, steps_per_epoch=4, epochs=1), toy.components(),
        run_dir=Path(config.run_dir), val_dataset=samples,
        forward=lambda model, batch: model(batch), eval_loss=lambda output, batch: output.float().mean(),
        **{"sampler": lambda prompt, settings, generator: "", **fields},
    )  # fmt: skip


def held() -> dict:
    """What a hook may hold between TRAIN_BEGIN and TRAIN_END / ABORT, as this process sees it."""
    return {
        "fds": sorted(os.listdir("/proc/self/fd")),
        "threads": sorted(t.name for t in threading.enumerate() if t.is_alive()),
        "gc": gc.isenabled(),
        "signals": [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)],
        "log_handlers": list(logging.getLogger().handlers),
        "profiling": torch.autograd.profiler._is_profiler_enabled,
    }


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setattr(progress_module, "_stderr_is_terminal", lambda: True)  # so a bar opens


def test_the_list_is_built_in_standard_order_and_creates_no_file(tmp_path, terminal):
    run_dir = tmp_path / "run"
    extra = lambda event, state, info: None  # noqa: E731
    wiring = wire_standard_hooks(inputs_for(every_hook_on(run_dir), extra=(extra,)))
    hooks = wiring.hooks
    names = [hook.name if isinstance(hook, StatefulHook) else None for hook in hooks]
    assert len(hooks) == 11 and hooks[8] is extra
    assert names[1] == "throughput" and names[4] == "evaluate" and names[9] == "checkpoint"
    assert wiring.writer is not None and wiring.writer.latest() == {}
    assert not run_dir.exists()  # built: nothing on disk until TRAIN_BEGIN


def test_only_the_metrics_hook_when_every_other_hook_is_off(tmp_path):
    config = sections(
        tmp_path, throughput=ThroughputConfig(enabled=False),
        progress=ProgressConfig(enabled=False), watchdog=WatchdogConfig(enabled=False),
    )  # fmt: skip
    wiring = wire_standard_hooks(inputs_for(config))
    assert len(wiring.hooks) == 1 and wiring.writer is not None


@pytest.mark.parametrize(
    ("factory", "off"),
    [
        (standard._memory, {}),
        (standard._throughput, {"throughput": ThroughputConfig(enabled=False)}),
        (standard._progress, {"progress": ProgressConfig(enabled=False)}),
        (standard._evaluate, {}),
        (standard._sample, {}),  # no prompts
        (standard._gc, {}),
        (standard._profiler, {}),
        (standard._checkpoint, {}),
        (standard._watchdog, {"watchdog": WatchdogConfig(enabled=False)}),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_a_factory_of_a_hook_that_is_off_returns_none(tmp_path, factory, off):
    inputs = inputs_for(sections(tmp_path, **off))
    assert factory(inputs, make_wiring(inputs)) is None


def test_evaluation_is_off_without_validation_data_and_extra_is_empty_without_hooks(tmp_path):
    config = sections(tmp_path, evaluate=EvaluateConfig(eval_every=1))
    for val_dataset in (None, []):
        inputs = dataclasses.replace(inputs_for(config), val_dataset=val_dataset)
        assert standard._evaluate(inputs, make_wiring(inputs)) is None
    inputs = inputs_for(config)
    assert standard._extra(inputs, make_wiring(inputs)) == ()
    assert standard._metrics(inputs, make_wiring(inputs)) is not None  # never off: it ends the log


def test_a_validation_split_implies_evaluation_and_a_line_says_when(tmp_path, caplog):
    """[issue 27] evaluate.with_validation and no cadence: a validation split is evaluated at the end
    and every tenth of the run (here every step of 4), and one log line says so; without a split, or
    with with_validation off, there is no evaluation."""
    config = sections(tmp_path, evaluate=EvaluateConfig(with_validation=True))
    inputs = inputs_for(config)
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.evaluate"):
        hook = standard._evaluate(inputs, make_wiring(inputs))
    assert hook is not None
    assert "evaluating on 3 validation samples every 1 steps and at the end" in caplog.text
    none = dataclasses.replace(inputs, val_dataset=[])
    assert standard._evaluate(none, make_wiring(none)) is None
    off = inputs_for(sections(tmp_path, evaluate=EvaluateConfig()))
    assert standard._evaluate(off, make_wiring(off)) is None


FACTORIES = [factory for factory in standard.STANDARD_FACTORIES if factory is not standard._extra]


@pytest.mark.parametrize("began", [False, True], ids=["before-train-begin", "after-train-begin"])
@pytest.mark.parametrize("factory", FACTORIES, ids=lambda factory: factory.__name__.strip("_"))
def test_every_standard_hook_survives_an_early_abort(tmp_path, terminal, factory, began):
    run_dir = tmp_path / "run"
    inputs = inputs_for(every_hook_on(run_dir))
    before = held()
    hook = factory(inputs, make_wiring(inputs))
    assert hook is not None
    if began:
        drive(hook, 0, end=None)  # TRAIN_BEGIN only
    drive(hook, 0, begin=False, end=Event.ABORT, error=RuntimeError("early"))  # raises nothing
    assert held() == before  # files closed, threads and profiler stopped, gc, signals, logging restored
    if not began:
        assert not run_dir.exists()  # an ABORT before TRAIN_BEGIN touches no disk
