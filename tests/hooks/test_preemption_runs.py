"""Preemption [S19]: a SIGTERM in the middle of a run saves a checkpoint at the next step boundary, the
process exits with the documented status (143), a second signal ends it at once, and the run resumed
from that checkpoint ends bit for bit like a run never interrupted."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fntrain.checkpoint import SaveTarget, find_latest, list_checkpoints, read_meta
from fntrain.hooks.checkpoint import checkpoint_hook
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.hooks.signals import (
    DEFAULT_EXIT_CODE,
    Preemption,
    preemption_reason,
    signal_numbers,
)
from fntrain.loop import Event
from fntrain.run.config import CheckpointConfig
from fntrain.run.job import run_job
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from recipes import tiny_gpt
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]


def test_documented_exit_code_is_128_plus_sigterm():
    assert DEFAULT_EXIT_CODE == 128 + signal.SIGTERM == CheckpointConfig().preempt_exit_code == 143


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        ("SIGTERM", TypeError, "must be a tuple"),
        (("SIGNOPE",), ValueError, "must name signals like SIGTERM"),
        (("SIGINT",), ValueError, "cannot include SIGINT"),
    ],
)
def test_signal_names_are_checked(names, error, match):
    with pytest.raises(error, match=match):
        signal_numbers(names)


def test_exit_code_is_validated():
    with pytest.raises(ValueError, match="checkpoint.preempt_exit_code must be an int in"):
        Preemption(exit_code=256)
    with pytest.raises(ValueError, match="checkpoint.preempt_exit_code"):
        CheckpointConfig(preempt_exit_code=-1).validate()


def test_first_signal_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption(("SIGUSR1",), exit_code=99)
    assert preemption.install() and preemption.installed
    signal.raise_signal(signal.SIGUSR1)
    assert preemption.requested and preemption.received == "SIGUSR1"
    # The handler already handed the signal back to the kernel's default for the next one.
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    preemption.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before and not preemption.installed


def test_the_reason_names_the_signal():
    assert preemption_reason("SIGTERM", 4) == "preempted by SIGTERM at step 4"
    assert preemption_reason(None, 4) == "preempted by a notice on another rank at step 4"


def test_second_signal_terminates_at_once():
    """In a child: the first SIGTERM only sets the flag; the second ends the process by SIGTERM even
    though the main thread is busy (a shell reports 128 + 15 = 143)."""
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from fntrain.hooks.signals import Preemption
        preemption = Preemption(("SIGTERM", "SIGUSR1"))
        preemption.install()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 20   # the handler runs at the next bytecode boundary; poll for it
        while not preemption.requested and time.monotonic() < deadline:
            time.sleep(0.001)
        print("requested", preemption.requested, preemption.received, flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)   # any configured signal counts as the second
        deadline = time.monotonic() + 20   # the kernel ends the process inside os.kill; this only bounds it
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print("still alive", flush=True)
        """
    )
    result = run_to_end([sys.executable, "-c", script], "the child signalling itself twice", 30, cwd=ROOT)
    assert result.returncode == -signal.SIGUSR1, (result.returncode, result.stderr)
    assert "requested True SIGTERM" in result.stdout and "still alive" not in result.stdout


def test_handlers_only_in_the_main_thread():
    import threading

    installed = []
    preemption = Preemption(("SIGUSR1",))
    thread = threading.Thread(target=lambda: installed.append(preemption.install()))
    thread.start()
    thread.join()
    assert installed == [False] and not preemption.installed


# ----------------------------------------------------------------------------- the recipe, in process


def preemption_run_config(tmp_path: Path, run: str, **checkpoint: Any) -> tiny_gpt.Config:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:1700])
    base = tiny_gpt.Config()
    return dataclasses.replace(
        base,
        run_dir=str(tmp_path / run),
        log_every=0,
        model=dataclasses.replace(base.model, context=32, n_layer=1, n_head=2, d_model=32, dropout=0.1),
        data=dataclasses.replace(base.data, path=str(corpus)),
        train=dataclasses.replace(base.train, train_iters=9, global_batch_size=8, micro_batch_size=4),
        schedule=dataclasses.replace(base.schedule, warmup_iters=2),
        checkpoint=dataclasses.replace(base.checkpoint, save_every=100, **checkpoint),
        evaluate=EvaluateConfig(eval_every=0, at_end=False),
        progress=ProgressConfig(enabled=False),
    )


def record_and_signal(losses: dict[int, float], signal_at: int | None = None) -> Any:
    """The recipe's spec with one extra hook: record each step's loss; at STEP_BEGIN of step
    `signal_at`, SIGTERM this process (handled by the checkpoint hook's handler: only a flag is set)."""

    def recorder(event: Event, state: Any, info: Any) -> None:
        if event is Event.STEP_BEGIN and state.global_step + 1 == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        elif event is Event.STEP_END:
            losses[state.global_step] = float(info.metrics["loss"])

    return dataclasses.replace(tiny_gpt.spec, hooks=lambda built: [recorder])  # before the checkpoint hook


def test_sigterm_saves_at_the_next_boundary_exits_143_and_resumes_bit_for_bit(tmp_path):
    sigterm_before = signal.getsignal(signal.SIGTERM)
    expected: dict[int, float] = {}
    run_job(preemption_run_config(tmp_path, "reference"), record_and_signal(expected))
    assert sorted(expected) == list(range(1, 10))

    first: dict[int, float] = {}
    stopped = run_job(
        preemption_run_config(tmp_path, "run", restore_from="auto"), record_and_signal(first, signal_at=4)
    )
    assert (stopped.outcome, stopped.exit_code, stopped.state.global_step) == ("preempted", 143, 4)
    assert "SIGTERM" in stopped.reason
    assert signal.getsignal(signal.SIGTERM) is sigterm_before  # handlers removed again
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_4"]  # the step the signal arrived in
    assert read_meta(find_latest(root))["train_state"]["global_step"] == 4
    assert not (tmp_path / "run" / "model.safetensors").exists()  # a preempted run exports nothing
    assert sorted(first) == [1, 2, 3, 4]

    second: dict[int, float] = {}
    final = run_job(preemption_run_config(tmp_path, "run", restore_from="auto"), record_and_signal(second)).state
    assert final.global_step == 9 and sorted(second) == [5, 6, 7, 8, 9]
    assert {**first, **second} == expected  # bit for bit: floats compared with ==
    want = load_file(tmp_path / "reference" / "model.safetensors")
    got = load_file(tmp_path / "run" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_the_checkpoint_hook_installs_the_configured_signals_itself(tmp_path):
    from tests.checkpoint import toy

    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    config = CheckpointConfig(save_every=100, preempt_signals=("SIGUSR1",), preempt_exit_code=3)
    hook = checkpoint_hook(config, SaveTarget(tmp_path, toy.components()), Runtime())
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before  # not yet
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    try:
        assert signal.getsignal(signal.SIGUSR1) is not before[0]  # only the configured signal
        assert signal.getsignal(signal.SIGTERM) is before[1]
    finally:
        hook(Event.TRAIN_END, TrainState(), None)
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before


def test_the_process_exits_with_the_documented_status(tmp_path, fork_env):
    """`python -m recipes.tiny_gpt` (here through tests/run/fault_driver.py, which calls its main): SIGTERM
    at step 3 -> checkpoint step 3, exit status 143, no traceback."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:1700])
    run_dir = tmp_path / "run"
    command = [
        fork_env["PYTHON_FORK"], "-m", "tests.run.fault_driver", str(run_dir), "sigterm:0:3", "--run-dir", str(run_dir),
        "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
        "--train.global-batch-size", "8", "--train.micro-batch-size", "4", "--train.train-iters", "12",
        "--log-every", "0", "--data.path", str(corpus), "--checkpoint.save-every", "100",
        "--progress.no-enabled", "--evaluate.eval-every", "0",
    ]  # fmt: skip
    what = "`python -m recipes.tiny_gpt` sent SIGTERM at step 3"
    result = run_to_end(command, what, 120, cwd=ROOT, env=fork_env)
    assert result.returncode == 143, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "preemption (SIGTERM): saving step 3" in result.stderr
    assert (run_dir / "exit_0.txt").read_text() == "143"
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_3"]
    log_text = (run_dir / "logs" / "rank_0.log").read_text()
    assert "saving step 3 and stopping (exit status 143)" in log_text
