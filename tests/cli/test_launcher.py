"""The launcher: `fntrain run --nproc-per-node N [torchrun's options] RECIPE ...` (fntrain.cli.launcher).

- default tier: which arguments are torchrun's and which the recipe's; the one line and exit status
  chosen from the ranks' records and torch's `ChildFailedError` (made by hand); a rank's last line goes
  to the launcher's directory, not to stderr; the launch wired to a stand-in for torchrun's `run`.
- slow tier (2 ranks, gloo on CPU, a 1-layer width-32 tiny_gpt, a few steps): the same losses as plain
  torchrun; a bad setting, a failing rank and Ctrl-C each end in one line and their status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from fntrain.cli.errors import UsageError
from fntrain.cli.final_line import LINES_ENV, say
from fntrain.cli.launcher import Ending, ending, is_launch, launch, read_lines, split_launch
from tests.helpers.waiting import run_to_end, wait_for_end

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- default tier


def test_torchruns_options_come_before_the_recipe_and_the_recipes_after_it():
    assert is_launch(["--nproc-per-node", "2", "tiny_gpt"]) and is_launch(["--nproc_per_node=2", "tiny_gpt"])
    assert is_launch(["--nnodes", "1", "--nproc-per-node", "2", "tiny_gpt"])
    assert not is_launch(["tiny_gpt", "--nproc-per-node", "2"])  # a recipe run (its options are tyro's)
    assert not is_launch([]) and not is_launch(["--help"]) and not is_launch(["--config", "base.toml"])

    options, recipe, rest = split_launch(["--nproc-per-node", "2", "--max-restarts=1", "tiny_gpt",
                                          "--parallel.strategy", "ddp", "--max-restarts", "3"])  # fmt: skip
    assert (options.nproc_per_node, options.max_restarts) == ("2", 1)
    assert recipe == "tiny_gpt" and rest == ["--parallel.strategy", "ddp", "--max-restarts", "3"]
    options, recipe, rest = split_launch(["--nnodes=2", "--nproc-per-node=8", "--node-rank", "1",
                                          "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400", "my.py"])  # fmt: skip
    assert (options.nnodes, options.node_rank, options.rdzv_endpoint, recipe, rest) == (
        "2",
        1,
        "host:29400",
        "my.py",
        [],
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "2"], "needs a RECIPE"),
        (["--nproc-per-node", "2", "--parallel.strategy", "ddp", "tiny_gpt"], "--parallel.strategy"),
        (["--nproc-per-node", "2", "-m", "tiny_gpt"], "--module is not for fntrain run"),
        (["--nproc-per-node", "two", "tiny_gpt"], "--nproc-per-node must be a positive integer, or cpu, gpu or auto, got 'two'"),
        (["--nproc-per-node=0", "tiny_gpt"], "--nproc-per-node must be a positive integer, .* got '0'"),
    ],
)
def test_a_bad_launcher_command_line_is_a_usage_error(args, message):
    with pytest.raises(UsageError, match=message):
        split_launch(args)


def test_fntrain_run_with_torchruns_options_and_no_recipe_exits_2_before_any_rank(capsys):
    with pytest.raises(SystemExit) as exited:
        dispatch(["run", "--nproc-per-node", "2"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("fntrain run: needs a RECIPE after torchrun's options")


def test_a_bad_nproc_per_node_exits_2_in_one_line_before_any_rank_and_the_corrected_count_parses(tmp_path, capsys):
    """[issue 48] `--nproc-per-node two` ended with the agent's failure, exit status 1."""
    with pytest.raises(SystemExit) as exited:
        dispatch(["run", "--nproc-per-node", "two", "tiny_gpt", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("fntrain run: --nproc-per-node must be a positive integer, or cpu, gpu or auto, got 'two'")
    assert list(tmp_path.iterdir()) == []
    options, recipe, _ = split_launch(["--nproc-per-node", "2", "tiny_gpt"])
    assert (options.nproc_per_node, recipe) == ("2", "tiny_gpt")


def _failures(*exits):
    """torch's own `ProcessFailure`s for (rank, pid, exit status) (no error file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return {rank: ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file="/nonexistent/error.json")
            for rank, pid, code in exits}  # fmt: skip


def _record(rank, pid, line, code, at, attempt=0):
    return {"rank": rank, "pid": pid, "line": line, "exit_code": code, "time": at, "attempt": attempt}


def test_the_first_failing_ranks_line_and_status_end_the_job():
    bad = "fntrain run: --parallel.tp-size (3) must divide --model.n-head (4)"
    every_rank = [_record(1, 11, bad, 2, 5.0), _record(0, 10, bad, 2, 5.2)]
    assert ending(every_rank, failures=_failures((0, 10, 2), (1, 11, 2))) == Ending(bad, 2)

    crash = "run failed at step 2: RuntimeError: boom; full traceback in runs/x/logs/rank_1.log"
    follow = "run failed at step 2: RuntimeError: Connection reset by peer; full traceback in ..."
    records = [_record(0, 10, follow, 1, 7.5), _record(1, 11, crash, 1, 7.1)]
    assert ending(records, failures=_failures((0, 10, 1), (1, 11, 1))) == Ending(f"[rank 1] {crash}", 1)
    # A record of an earlier attempt (another pid) is not this failure's.
    stale = [_record(1, 99, "old line", 1, 1.0), *records]
    assert ending(stale, failures=_failures((0, 10, 1), (1, 11, 1))).line == f"[rank 1] {crash}"
    # Only the failing rank had time to say anything (the agent stopped the other): its line, with its rank.
    alone = [_record(1, 11, crash, 1, 7.1)]
    assert ending(alone, failures=_failures((0, 10, -15), (1, 11, 1))) == Ending(f"[rank 1] {crash}", 1)
    # ... but a bad setting is every rank's (they share the settings): its line alone, whoever said it.
    first_to_refuse = [_record(0, 10, bad, 2, 5.0)]
    assert ending(first_to_refuse, failures=_failures((0, 10, 2), (1, 11, -15))) == Ending(bad, 2)

    # No line: the rank and its status, a signal as the shell reports it (128 + the signal).
    assert ending([], failures=_failures((1, 11, 3))) == Ending(
        "fntrain run: rank 1 exited with status 3; its output is above", 3
    )
    assert ending([], failures=_failures((0, 10, -9))) == Ending(
        "fntrain run: rank 0 was killed by SIGKILL; its output is above", 137
    )


def test_a_signal_to_the_agent_ends_with_the_ranks_line_of_the_last_attempt():
    interrupted = "run interrupted at step 12; 6,096 tokens; 4.9 s; loss 5.051 (mean of steps 11-12)"
    records = [_record(0, 5, "an earlier attempt's line", 1, 1.0, attempt=0),
               _record(0, 7, interrupted, 130, 9.0, attempt=1), _record(1, 8, interrupted, 130, 9.1, attempt=1)]  # fmt: skip
    assert ending(records, signal_number=int(signal.SIGINT)) == Ending(interrupted, 130)
    assert ending([], signal_number=int(signal.SIGTERM)) == Ending("fntrain run: stopped by SIGTERM", 143)


def test_a_ranks_last_line_goes_to_the_launchers_directory_not_to_stderr(tmp_path, monkeypatch, capsys):
    say("fntrain run: a line", 2)
    assert capsys.readouterr().err == "fntrain run: a line\n"  # no launcher: stderr, as before
    monkeypatch.setenv(LINES_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    say("fntrain run: a line", 2)
    assert capsys.readouterr().err == ""
    (record,) = read_lines(tmp_path)
    assert (record["line"], record["exit_code"], record["rank"], record["attempt"], record["pid"]) == (
        "fntrain run: a line",
        2,
        1,
        2,
        os.getpid(),
    )
    monkeypatch.setenv(LINES_ENV, str(tmp_path / "gone"))  # the directory is gone: the line is not lost
    say("fntrain run: another", 1)
    assert capsys.readouterr().err == "fntrain run: another\n"


def test_launch_runs_fntrain_run_under_torchruns_run_and_reads_the_ranks_lines(monkeypatch):
    """torchrun's `run` replaced by a stand-in that checks what it was given and fails like the agent."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    seen = {}

    def agent(options):
        seen.update(module=options.module, script=options.training_script, args=options.training_script_args)
        directory = Path(os.environ[LINES_ENV])
        (directory / "attempt_0_rank_0_10.json").write_text(
            json.dumps(_record(0, 10, "fntrain run: bad", 2, 1.0))
        )
        raise ChildFailedError("fntrain", _failures((0, 10, 2)))

    monkeypatch.setattr(torchrun, "run", agent)
    options, recipe, rest = split_launch(["--nproc-per-node", "2", "tiny_gpt", "--seed", "3"])
    handler = signal.getsignal(signal.SIGINT)
    assert launch(options, [recipe, *rest]) == Ending("fntrain run: bad", 2)
    assert seen == {"module": True, "script": "fntrain", "args": ["run", "tiny_gpt", "--seed", "3"]}
    assert LINES_ENV not in os.environ and signal.getsignal(signal.SIGINT) is handler

    def broken_agent(options):
        raise TimeoutError("rendezvous timed out after 900 s\nmore detail")

    monkeypatch.setattr(torchrun, "run", broken_agent)
    assert launch(options, [recipe, *rest]) == Ending(
        "fntrain run: torchrun's agent failed: TimeoutError: rendezvous timed out after 900 s", 1
    )


def test_under_several_ranks_the_preemption_line_says_when_the_notice_came_and_when_the_ranks_stopped():
    """The ranks agree on a stop every --checkpoint.preempt-check-every steps: a notice that came during
    step 13 stops them at step 20, and both the warning and the final line say so."""
    from fntrain.hooks.preemption import make_agreement
    from fntrain.hooks.signals import Preemption, preemption_reason
    from fntrain.runtime.runtime import Runtime
    from fntrain.state import TrainState

    two_ranks = Runtime(world_size=2, backend="gloo")
    agreement = make_agreement(two_ranks, signals=("SIGUSR1",), check_every=10)
    assert agreement.preemption.when.startswith("at the next step that is a multiple of 10")
    assert make_agreement(Runtime(), signals=("SIGUSR1",)).preemption.when == "at the next step boundary"
    agreement.decide(TrainState(global_step=12))
    agreement.preemption.request("SIGUSR1")
    agreement.decide(TrainState(global_step=13))  # not an agreed step: no collective, only noted
    agreement.decide(TrainState(global_step=14))
    assert agreement.noticed_at() == 13
    assert preemption_reason("SIGTERM", 20, 13) == ("preempted by SIGTERM at step 20 (received during step 13; "
                                                    "the ranks stop together every --checkpoint.preempt-check-every steps)")  # fmt: skip
    assert (
        preemption_reason("SIGTERM", 4, 4)
        == preemption_reason("SIGTERM", 4)
        == "preempted by SIGTERM at step 4"
    )
    assert Preemption(("SIGUSR1",)).when == "at the next step boundary"


# ----------------------------------------------------------------------------- slow tier: real ranks

TINY = ["--runtime.device", "cpu", "--parallel.strategy", "ddp", "--model.n-layer", "1", "--model.d-model", "32",
        "--model.n-head", "2", "--model.context", "32", "--train.global-batch-size", "4",
        "--train.micro-batch-size", "2", "--progress.no-enabled", "--evaluate.eval-every", "0",
        "--evaluate.no-at-end", "--checkpoint.save-every", "0", "--log-every", "1"]  # fmt: skip

# A recipe file whose rank 1 fails at the start of step 2.
FAILING_RECIPE = '''"""tiny_gpt whose rank 1 fails at step 2."""
import dataclasses
import os

from fntrain.loop import Event
from recipes.tiny_gpt import Config, spec as tiny_spec  # noqa: F401


def hooks(built):
    def fail(event, state, info):
        if event is Event.STEP_BEGIN and state.global_step == 1 and os.environ.get("RANK") == "1":
            raise RuntimeError("injected failure on rank 1")
    return [fail]


spec = dataclasses.replace(tiny_spec, hooks=hooks)
'''


@pytest.fixture(scope="module")
def launcher_python(fork_env):
    """The Python the slow tests launch `fntrain run` and torchrun with: tests/helpers/fork_server.py's
    launcher (the agent a fork of one process that imported torch once), and the environment to run
    them with. The ranks stay fresh interpreters (no PYTHON_EXEC): the launcher matches a rank's last
    line to torchrun's record of the rank by its pid, which a fork behind a launcher does not share."""
    left_out = ("PYTHON_EXEC", "MASTER_PORT", "LOGLEVEL", "FNTRAIN_TRACEBACK")
    return fork_env["PYTHON_FORK"], {key: value for key, value in fork_env.items() if key not in left_out}


def _fntrain(python, cwd: Path, *args: str, what: str, timeout: float = 240) -> subprocess.CompletedProcess:
    executable, env = python
    return run_to_end([executable, "-m", "fntrain", "run", *args], what, timeout, cwd=cwd, env=env)


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if "loss" in row]


@pytest.mark.slow
def test_the_launcher_trains_as_torchrun_does_and_a_bad_setting_is_one_line(tmp_path, launcher_python):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:4000])
    common = ["tiny_gpt", *TINY, "--data.path", str(corpus), "--train.train-iters", "3"]
    launched = _fntrain(launcher_python, tmp_path, "--nproc-per-node", "2", *common, "--run-dir", "launched",
                        what="the 2-rank `fntrain run --nproc-per-node 2 tiny_gpt`")  # fmt: skip
    assert launched.returncode == 0, launched.stderr[-3000:]
    plain = run_to_end([launcher_python[0], "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "fntrain", "run", *common, "--run-dir", "plain"],
                       "the 2-rank torchrun `fntrain run`", 240, cwd=tmp_path, env=launcher_python[1])  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert (
        logged_losses(tmp_path / "launched") == logged_losses(tmp_path / "plain")
        and len(logged_losses(tmp_path / "plain")) == 3
    )
    assert "OMP_NUM_THREADS" not in launched.stderr and "elastic" not in launched.stderr  # the agent is quiet

    bad = _fntrain(
        launcher_python,
        tmp_path,
        "--nproc-per-node",
        "2",
        *common,
        "--train.global-batch-size",
        "6",
        "--run-dir",
        "bad",
        what="the 2-rank `fntrain run` with a bad global batch size",
    )
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "fntrain run: --train.global-batch-size (6) must be divisible by --train.micro-batch-size (2) x "
        "data-parallel size (2) = 4"
    ], bad.stderr[-3000:]
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_failing_rank_and_ctrl_c_end_the_launched_job_in_one_line(tmp_path, launcher_python):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:4000])
    (tmp_path / "failing_gpt.py").write_text(FAILING_RECIPE)
    common = [*TINY, "--data.path", str(corpus)]
    failed = _fntrain(launcher_python, tmp_path, "--nproc-per-node", "2", "failing_gpt.py", *common, "--train.train-iters", "4",
                      "--run-dir", "failed", what="the 2-rank `fntrain run` failing on rank 1")  # fmt: skip
    assert failed.returncode == 1, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("[rank 1] run failed at step 2: RuntimeError: injected failure on rank 1; full "
                           "traceback in failed/logs/rank_1.log"), failed.stderr[-3000:]  # fmt: skip
    assert "Traceback" not in failed.stderr and "ChildFailedError" not in failed.stderr

    # Ctrl-C reaches the agent (the ranks run in sessions of their own): it passes SIGINT on.
    stderr = tmp_path / "interrupted.err"
    with stderr.open("w") as sink:
        agent = subprocess.Popen([launcher_python[0], "-m", "fntrain", "run", "--nproc-per-node", "2", "tiny_gpt",
                                  *common, "--train.train-iters", "5000", "--run-dir", "interrupted"],
                                 cwd=tmp_path, env=launcher_python[1], stdout=subprocess.DEVNULL, stderr=sink)  # fmt: skip
        metrics = tmp_path / "interrupted" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while (
            agent.poll() is None
            and time.monotonic() < deadline
            and not (metrics.exists() and metrics.stat().st_size)
        ):
            time.sleep(0.2)
        agent.send_signal(signal.SIGINT)
        try:
            wait_for_end(agent, "the 2-rank `fntrain run` after Ctrl-C (SIGINT)", 90, stderr.read_text)
        finally:
            agent.kill()
    code = agent.returncode
    text = stderr.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert "run interrupted at step" in text.strip().splitlines()[-1], text[-3000:]
