"""Hang watchdog: the limit (grace, floor, factor x median), firing on an injected stall with a stack
dump per rank, peers following a rank that reported a hang, the thread's lifetime; the slow tier runs
2 ranks under torchrun with one rank stalled."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from fntrain import RunPlan, StepInfo, TrainState, train
from fntrain.hooks.watchdog import watchdog_hook
from fntrain.loop import Event
from fntrain.runtime.runtime import Runtime
from fntrain.runtime.watchdog import EXIT_CODE, HANG_MARKER, THREAD_NAME, Watchdog, WatchdogConfig
from tests.helpers.ports import free_port
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]
INFO = StepInfo({"loss": 0.0})


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(tmp_path: Path, clock: FakeClock, aborted: list[int], rank: int = 0, **fields) -> Watchdog:
    config = WatchdogConfig(**{"factor": 3.0, "floor_s": 5.0, "grace_steps": 2, "grace_s": 60.0, **fields})
    return Watchdog(config, rank=rank, stacks_dir=tmp_path / "stacks", clock=clock, abort=aborted.append)


def beat_steps(dog: Watchdog, clock: FakeClock, durations: list[float], start: int = 0) -> int:
    step = start
    for duration in durations:
        dog.beat("step", step + 1)
        clock.now += duration
        step += 1
        dog.step_done(step)
    return step


def no_watchdog_thread() -> bool:
    return not any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("factor", 0.5, ValueError, "watchdog.factor must be >= 1"),
        ("floor_s", 0.0, ValueError, "watchdog.floor_s"),
        ("grace_steps", -1, ValueError, "watchdog.grace_steps"),
        ("window", 0, ValueError, "watchdog.window"),
        ("exit_code", 0, ValueError, "watchdog.exit_code"),
        ("enabled", 1, TypeError, "watchdog.enabled must be a bool"),
    ],
)
def test_config_errors_name_the_field(field, value, error, match):
    with pytest.raises(error, match=match):
        WatchdogConfig(**{field: value}).validate()


def test_limit_grace_then_median_times_factor_with_a_floor(tmp_path):
    clock, aborted = FakeClock(), []
    dog = watchdog(tmp_path, clock, aborted)
    assert dog.limit()[0] == 60.0  # start-up grace
    beat_steps(dog, clock, [30.0, 20.0])  # slow first steps (compilation) stay out of the median
    assert dog.limit()[0] == 60.0  # no period known yet
    beat_steps(dog, clock, [1.0, 1.0, 4.0], start=2)
    limit, why = dog.limit()
    assert limit == 5.0 and "floor" in why  # 3 x median 1 s = 3 s < floor 5 s
    beat_steps(dog, clock, [4.0, 4.0, 4.0], start=5)
    assert dog.limit()[0] == pytest.approx(12.0)  # 3 x median(1, 1, 4, 4, 4, 4) = 3 x 4
    assert not dog.check() and aborted == []


def test_fires_on_a_stall_dumps_stacks_and_aborts_with_the_exit_code(tmp_path):
    clock, aborted = FakeClock(), []
    dog = watchdog(tmp_path, clock, aborted, rank=3)
    step = beat_steps(dog, clock, [1.0] * 6)
    dog.beat("step", step + 1)
    clock.now += 4.9
    assert not dog.check()  # under the floor
    clock.now += 0.2
    assert dog.check() and aborted == [EXIT_CODE]
    text = (tmp_path / "stacks" / "rank_3.txt").read_text()
    assert "rank 3" in text and "inside step 7" in text and "limit 5.0 s" in text
    assert "test_fires_on_a_stall_dumps_stacks_and_aborts_with_the_exit_code" in text  # this thread's stack
    report = json.loads((tmp_path / "stacks" / HANG_MARKER).read_text())
    assert report["rank"] == 3 and "inside step 7" in report["reason"]
    clock.now += 100
    assert not dog.check() and aborted == [EXIT_CODE]  # fires once


def test_a_rank_follows_a_peer_that_reported_a_hang(tmp_path):
    """Rank 1 is not past its own limit (waiting in a collective, say) but rank 0 reported a hang:
    rank 1 dumps its stacks and aborts too."""
    clock, aborted = FakeClock(), []
    stale = tmp_path / "stacks" / HANG_MARKER
    stale.parent.mkdir()
    stale.write_text(json.dumps({"rank": 0, "reason": "an earlier launch"}))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    hung = watchdog(tmp_path, clock, aborted, rank=0)
    waiting = watchdog(tmp_path, clock, aborted, rank=1, floor_s=1000.0)
    hung._started_wall = waiting._started_wall = time.time() - 1
    assert not waiting.check()  # a marker left by an earlier launch is ignored
    beat_steps(hung, clock, [1.0] * 4)
    beat_steps(waiting, clock, [0.0] * 4)
    hung.beat("step", 5)
    clock.now += 10
    assert hung.check() and not (tmp_path / "stacks" / "rank_1.txt").exists()
    assert waiting.check() and aborted == [EXIT_CODE, EXIT_CODE]
    text = (tmp_path / "stacks" / "rank_1.txt").read_text()
    assert "rank 0 reported a hang" in text


def test_in_a_training_loop_the_thread_finds_the_stalled_step(tmp_path):
    """A real monitor thread: step 5 stalls (waiting until aborted); the stack file names the stalled
    function, the abort function runs once, and no watchdog thread outlives `train`."""
    released = threading.Event()
    aborted: list[int] = []

    def abort(code: int) -> None:
        aborted.append(code)
        released.set()

    def stalled_step() -> None:
        released.wait(10.0)

    def step_fn(state: TrainState, batch: int) -> dict:
        if state.global_step == 4:
            stalled_step()
        else:
            time.sleep(0.01)
        return {}

    config = WatchdogConfig(factor=5.0, floor_s=0.5, grace_steps=1, grace_s=5.0, poll_s=0.02, exit_code=77)
    hook = watchdog_hook(config, Runtime(rank=2), tmp_path, abort=abort)
    plan = RunPlan(train_iters=8, steps_per_epoch=8, epochs=1)
    started = time.monotonic()
    final = train(TrainState(), step_fn, [hook], data=lambda epoch, cursor: iter(range(cursor, 8)), plan=plan).state
    assert final.global_step == 8 and aborted == [77]
    assert time.monotonic() - started < 5.0
    text = (tmp_path / "stacks" / "rank_2.txt").read_text()
    assert "inside step 5" in text and "stalled_step" in text and "Thread" in text
    assert no_watchdog_thread()


def test_stopped_at_abort_and_harmless_before_train_begin(tmp_path):
    hook = watchdog_hook(WatchdogConfig(poll_s=0.01), Runtime(), tmp_path)
    hook(Event.ABORT, TrainState(), RuntimeError("before the start"))  # never began: a no-op
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert not no_watchdog_thread()
    hook(Event.STEP_BEGIN, TrainState(), None)
    hook(Event.ABORT, TrainState(), RuntimeError("crash"))
    assert no_watchdog_thread()
    assert not (tmp_path / "stacks").exists()


def test_disabled_starts_nothing(tmp_path):
    hook = watchdog_hook(WatchdogConfig(enabled=False), Runtime(), tmp_path)
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert no_watchdog_thread()
    hook(Event.STEP_BEGIN, TrainState(), None)
    hook(Event.STEP_END, TrainState(0, 1, 1), INFO)
    hook(Event.TRAIN_END, TrainState(0, 1, 1), None)


# ----------------------------------------------------------------------------- 2 ranks under torchrun


@pytest.mark.slow
def test_two_ranks_one_stalled_both_dump_stacks_and_exit(tmp_path):
    """Rank 1 sleeps 60 s inside step 4 (tests/run/fault_driver.py); rank 0 blocks in its next collective.
    Both watchdogs fire after ~3 s of silence, each rank writes its stacks, and the workers exit with
    the watchdog's status (124), long before the collective timeout (300 s) or the stall's end."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:1700])
    run_dir = tmp_path / "run"
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hang{port}",
        "-m", "tests.run.fault_driver", str(run_dir), "stall:1:4:60", "--run-dir", str(run_dir),
        "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
        "--train.global-batch-size", "8", "--train.micro-batch-size", "2", "--train.train-iters", "12",
        "--log-every", "0", "--data.path", str(corpus), "--parallel.strategy", "ddp",
        "--progress.no-enabled", "--runtime.timeout-s", "300",
        "--watchdog.floor-s", "3", "--watchdog.factor", "5", "--watchdog.grace-steps", "1",
        "--watchdog.grace-s", "30", "--watchdog.poll-s", "0.1",
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    started = time.monotonic()
    what = "the 2-rank torchrun run with rank 1 stalled at step 4"
    result = run_to_end(command, what, 120, cwd=ROOT, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and time.monotonic() - started < 50, output[-4000:]
    assert f"exitcode  : {EXIT_CODE}" in output, output[-4000:]
    stacks = run_dir / "stacks"
    for rank in (0, 1):
        text = (stacks / f"rank_{rank}.txt").read_text()
        assert text.startswith(f"=== fntrain watchdog, rank {rank}") and "most recent call first" in text
        assert "fntrain/loop.py" in text  # the main thread, caught inside the training loop
        assert f"watchdog: rank {rank}:" in (run_dir / "logs" / f"rank_{rank}.log").read_text()
    assert "stalling_step" in (stacks / "rank_1.txt").read_text()
    assert json.loads((stacks / HANG_MARKER).read_text())["rank"] in (0, 1)
