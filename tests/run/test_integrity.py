"""Run integrity, tried as a careless user would: one run per directory, metrics that tell one story,
a resume only into the same run, interrupts that save, and a run that says what happened. The CLI
cases run `fntrain` (or tests/run/fault_driver.py, the same path with one injected signal) in subprocesses."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fntrain.checkpoint import list_checkpoints
from fntrain.cli.plot import read_metrics
from fntrain.config import ConfigError
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.run.config import CheckpointConfig
from fntrain.run.job import run_job
from recipes import tiny_gpt
from tests.helpers.commands import last_line
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
    "--train.global-batch-size", "8", "--train.micro-batch-size", "4", "--train.train-iters", "6",
    "--log-every", "1", "--progress.no-enabled", "--evaluate.eval-every", "0", "--evaluate.no-at-end",
]  # fmt: skip


# The launches go through the test process's fork server (the `fork_env` fixture, tests/helpers/fork_server.py:
# each a fork of one process that imported torch and fntrain once).
PYTHON: dict[str, object] = {}
pytestmark = pytest.mark.usefixtures("module_launches_forked")


def corpus_in(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    if not path.exists():
        path.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:3000])
    return path


def fntrain(tmp_path: Path, *args: str, driver: str | None = None) -> subprocess.CompletedProcess:
    """`fntrain run tiny_gpt ARGS` (or the fault driver with FAULT `driver`) in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(PYTHON.get("env", {}))
    head = ["-m", "fntrain", "run", "tiny_gpt"]
    if driver is not None:
        head = ["-m", "tests.run.fault_driver", str(tmp_path / "faults"), driver]
        (tmp_path / "faults").mkdir(exist_ok=True)
    python = str(PYTHON.get("executable", sys.executable))
    command = [python, *head, *TINY, "--data.path", str(corpus_in(tmp_path)), *args]
    what = f"`{shown(tmp_path, (*head[1:], *args))}`"
    return run_to_end(command, what, 180, cwd=tmp_path, env=env, preexec_fn=_ctrl_c_as_in_a_terminal)


def shown(tmp_path: Path, args: tuple[str, ...]) -> str:
    """ARGS as a failure message shows them: paths relative to the test's directory."""
    return " ".join(args).replace(str(tmp_path) + os.sep, "")


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT back to its default in the child: a shell's background job (`pytest ... &`) starts with
    SIGINT ignored, and a Python started so never raises KeyboardInterrupt, so the Ctrl-C tests would
    see a run that finishes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tiny_run_config(tmp_path: Path, **checkpoint) -> tiny_gpt.Config:
    base = tiny_gpt.Config()
    return dataclasses.replace(
        base,
        run_dir=str(tmp_path / "run"),
        log_every=1,
        model=dataclasses.replace(base.model, context=32, n_layer=1, n_head=2, d_model=32),
        data=dataclasses.replace(base.data, path=str(corpus_in(tmp_path))),
        train=dataclasses.replace(base.train, train_iters=6, global_batch_size=8, micro_batch_size=4),
        evaluate=EvaluateConfig(eval_every=0, at_end=False),
        progress=ProgressConfig(enabled=False),
        checkpoint=CheckpointConfig(**checkpoint),
    )


# ----------------------------------------------------------------------------- one run per directory


@pytest.mark.slow
def test_a_run_dir_is_resumed_refused_field_by_field_recovered_past_a_damaged_checkpoint_or_overwritten(
    tmp_path, python
):
    """One run directory through every later launch a careless user makes, in turn: a rerun of the same
    command resumes the run (here: it is complete); other settings are refused field by field (a cadence
    may change) unless allowed; restore_from none refuses a second run naming the ways out that work; a
    damaged newest checkpoint is refused when named and skipped by `latest`; --overwrite moves the old run
    aside whole."""
    run_dir = tmp_path / "run"
    assert fntrain(tmp_path, "--run-dir", str(run_dir), "--checkpoint.save-every", "3").returncode == 0
    before = (run_dir / "metrics.jsonl").read_bytes()

    again = fntrain(tmp_path, "--run-dir", str(run_dir), "--seed", "7")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert "other settings: --seed 42 -> 7" in again.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # nothing was touched

    never = fntrain(tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "none")
    assert never.returncode == 2 and len(never.stderr.strip().splitlines()) == 1
    message = never.stderr
    assert (
        "already holds a run" in message
        and "--checkpoint.restore-from auto (its newest checkpoint is step_6)" in message
    )
    assert "--overwrite" in message and "moves the old run to" in message

    resumed = fntrain(tmp_path, "--run-dir", str(run_dir), "--checkpoint.save-every", "3")
    assert resumed.returncode == 0 and "nothing to do" in resumed.stderr  # the same command: complete

    changed = fntrain(
        tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "latest", "--seed", "3",
        "--train.train-iters", "9", "--log-every", "2",
    )  # fmt: skip
    assert changed.returncode == 2 and len(changed.stderr.strip().splitlines()) == 1, changed.stderr
    assert "--seed 42 -> 3" in changed.stderr and "--train.train-iters 6 -> 9" in changed.stderr
    assert "log-every" not in changed.stderr  # a cadence may change freely
    assert "--checkpoint.allow-changes" in changed.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before

    # attempts so far: 0 (the first run) and 1 (the rerun that found it complete); the refusals are none
    assert_a_damaged_newest_checkpoint_is_skipped_and_named(tmp_path, run_dir, attempt=2)

    longer = fntrain(
        tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "latest", "--train.train-iters", "9",
        "--checkpoint.allow-changes", "train.train-iters", "--log-every", "2",
    )  # fmt: skip
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert "train.train_iters changed from 6 to 9" in longer.stderr
    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    assert metadata["allowed_changes"] == {"train.train_iters": [6, 9]}
    assert metadata["outcome"] == "completed" and metadata["end_state"]["global_step"] == 9

    old = (run_dir / "metrics.jsonl").read_bytes()
    fresh = fntrain(tmp_path, "--run-dir", str(run_dir), "--seed", "7", "--overwrite")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (aside / "metrics.jsonl").read_bytes() == old  # the old run, moved aside whole
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and {r["attempt"] for r in rows} == {0}


def assert_a_damaged_newest_checkpoint_is_skipped_and_named(
    tmp_path: Path, run_dir: Path, attempt: int
) -> None:
    """step_6 of the complete 6-step run in `run_dir` (saved every 3 steps) truncated, as by a full disk:
    named, it is refused in one line naming the file and why and left where it is; `latest` warns once,
    moves it aside and resumes from step 3 as the run's attempt `attempt`."""
    step_6 = run_dir / "checkpoints" / "step_6"
    shard = next(step_6.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk

    named = fntrain(tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", str(step_6))
    assert named.returncode == 2 and len(named.stderr.strip().splitlines()) == 1, named.stderr
    assert shard.name in named.stderr and "truncated" in named.stderr
    assert step_6.is_dir()  # an explicitly named checkpoint is left where it is

    latest = fntrain(tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "latest")
    assert latest.returncode == 0, latest.stderr[-2000:]
    warnings = [line for line in latest.stderr.splitlines() if shard.name in line]
    assert len(warnings) == 1 and "truncated" in warnings[0]  # one warning naming the file and why
    assert "run completed at step 6" in latest.stderr  # resumed from step 3, trained 4..6 again
    assert (run_dir / "checkpoints" / "step_6.damaged").is_dir()  # moved aside, not deleted
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and [r["attempt"] for r in rows][-1] == attempt


def test_a_run_dir_holding_only_a_failed_start_is_not_a_run(tmp_path):
    config = tiny_run_config(tmp_path)
    small = dataclasses.replace(
        config, train=dataclasses.replace(config.train, global_batch_size=4096, micro_batch_size=4096)
    )
    with pytest.raises(ConfigError, match="one complete optimizer step"):
        run_job(small, tiny_gpt.spec)  # the data holds fewer samples than one step
    assert not (tmp_path / "run").exists()  # found before any file was written
    assert run_job(config, tiny_gpt.spec).state.global_step == 6  # no --overwrite needed


# ----------------------------------------------------------------------------- metrics


def test_after_a_resume_every_step_is_logged_once_and_traced_to_its_attempt(tmp_path):
    config = tiny_run_config(tmp_path, save_every=2)
    run_job(config, tiny_gpt.spec)
    step_2 = tmp_path / "run" / "checkpoints" / "step_2"
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")
    run_job(
        dataclasses.replace(config, checkpoint=CheckpointConfig(save_every=2, restore_from=str(step_2))),
        tiny_gpt.spec,
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["attempt"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert [r["loss"] for r in rows] == [r["loss"] for r in first]  # exact resume: the same numbers
    superseded = read_metrics(tmp_path / "run" / "metrics.superseded.jsonl")
    assert [(r["step"], r["attempt"]) for r in superseded] == [(3, 0), (4, 0), (5, 0), (6, 0)]  # kept


# ----------------------------------------------------------------------------- the same run


# ----------------------------------------------------------------------------- interrupts


@pytest.mark.slow
def test_a_finished_run_says_so_and_ctrl_c_saves_at_the_next_boundary_exits_130_and_resumes_exactly(
    tmp_path, python
):
    """Every run ends with a summary; a finished run rerun says so. Ctrl-C with save-on-interrupt saves at
    the next step boundary, exits 130 in one line and resumes to the losses of the finished run."""
    reference = tmp_path / "reference"
    first = fntrain(tmp_path, "--run-dir", str(reference), "--checkpoint.save-every", "6")
    assert first.returncode == 0
    summary = [line for line in first.stderr.splitlines() if "run completed at step 6" in line]
    assert len(summary) == 1 and "tokens" in summary[0]
    assert re.search(r"; loss [\d.]+ \(step 6\);", summary[0])  # --log-every 1: step 6's own loss
    assert f"weights in {reference / 'hf_model'}, {reference / 'model.safetensors'}" in summary[0]
    again = fntrain(tmp_path, "--run-dir", str(reference), "--checkpoint.restore-from", "latest")
    assert again.returncode == 0 and "run already complete at step 6; nothing to do" in again.stderr
    assert not (reference / "metrics.superseded.jsonl").exists()

    run_dir = tmp_path / "run"
    stopped = fntrain(
        tmp_path, "--run-dir", str(run_dir), "--checkpoint.save-on-interrupt", driver="sigint:0:3"
    )
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert last_line(stopped) == (
        "preempted by SIGINT at step 3; checkpoint saved, resume with --checkpoint.restore-from latest"
    )
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_3"]
    assert not (run_dir / "model.safetensors").exists()  # an interrupted run exports nothing
    resumed = fntrain(
        tmp_path,
        "--run-dir",
        str(run_dir),
        "--checkpoint.save-on-interrupt",
        "--checkpoint.restore-from",
        "latest",
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want = [r["loss"] for r in read_metrics(reference / "metrics.jsonl")]  # saving changes no step
    assert [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")] == want


def test_ctrl_c_without_saving_is_one_line_and_status_130(tmp_path):
    """A plain Ctrl-C after the first step: the summary line, once [issue 48], exit status 130, and the
    outcome recorded."""
    stopped = fntrain(tmp_path, "--run-dir", str(tmp_path / "run"), driver="sigint:0:2")
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr
    line = last_line(stopped)
    assert line.startswith("run interrupted at step ") and line.endswith(  # the recipe saves every 100 steps
        "no checkpoint was saved yet (--checkpoint.save-on-interrupt saves at a Ctrl-C)"
    ), line
    assert stopped.stderr.count("run interrupted at step") == 1, stopped.stderr[-3000:]
    metadata = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert metadata["outcome"] == "interrupted" and metadata["summary"] == line


def test_a_second_ctrl_c_ends_the_process_at_once(tmp_path):
    """The first Ctrl-C hands SIGINT back to the kernel's default: a second one ends the process even
    while it is busy, as a shell reports (killed by SIGINT)."""
    code = (
        "import os, signal, time\n"
        "from fntrain.hooks.signals import Preemption\n"
        "p = Preemption((), interrupt=True); p.install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "assert p.requested\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    result = run_to_end([sys.executable, "-c", code], "the child sending itself SIGINT twice", 60, cwd=ROOT)
    assert result.returncode == -signal.SIGINT, result.stderr


# ----------------------------------------------------------------------------- saying what happened


# ----------------------------------------------------------------------------- two ranks


def torchrun_two_ranks(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update(PYTHON.get("env", {}))
    command = [
        str(PYTHON.get("executable", sys.executable)), "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "fntrain",
        "run", "tiny_gpt", *TINY, "--data.path", str(corpus_in(tmp_path)), "--parallel.strategy", "ddp", *args,
    ]  # fmt: skip
    what = f"the 2-rank torchrun `fntrain run tiny_gpt {shown(tmp_path, args)}`"
    return run_to_end(command, what, 240, cwd=tmp_path, env=env)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_refuse_a_second_run_and_a_changed_resume_together(tmp_path, python):
    run_dir = tmp_path / "run"
    first = torchrun_two_ranks(tmp_path, "--run-dir", str(run_dir), "--checkpoint.save-every", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run_dir / "metrics.jsonl").read_bytes()
    again = torchrun_two_ranks(tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "none")
    assert again.returncode != 0 and "already holds a run" in again.stderr  # one line per rank that said it
    changed = torchrun_two_ranks(
        tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "latest", "--seed", "5"
    )
    assert changed.returncode != 0 and "--seed 42 -> 5" in changed.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # neither launch touched the run
    resumed = torchrun_two_ranks(tmp_path, "--run-dir", str(run_dir), "--checkpoint.restore-from", "latest")
    assert resumed.returncode == 0 and "run already complete at step 6; nothing to do" in resumed.stderr


def test_overwrite_moves_a_run_aside_only_on_the_first_launch_of_a_job(tmp_path, monkeypatch):
    """Under torchrun --max-restarts, a restarted launch with --overwrite finds the run its own first
    launch started: it keeps it (and starts from its checkpoint with auto) instead of moving it aside."""
    config = dataclasses.replace(tiny_run_config(tmp_path, save_every=3, restore_from="auto"), overwrite=True)
    run_job(config, tiny_gpt.spec)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert run_job(config, tiny_gpt.spec).reason == "already complete"
    assert not list(tmp_path.glob("run.replaced-*"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new job: starts over, the old run kept aside
    assert run_job(config, tiny_gpt.spec).state.global_step == 6
    assert len(list(tmp_path.glob("run.replaced-*"))) == 1
