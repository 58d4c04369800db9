"""Automatic restart: `restore("auto")` (latest if a complete checkpoint exists, else a quiet fresh
start), and in the slow tier two jobs restarted by torchrun, each ending with the losses and weights of
one uninterrupted run (run once for the module):

- `torchrun --max-restarts 1` with a crash injected on rank 1: the restarted job resumes by itself;
- a frozen rank under `torchrun --max-restarts 2`: one worker is stopped (SIGSTOP: every thread of it
  frozen, as a dead NFS mount or a debugger leaves a process). The healthy rank's watchdog notices within
  its limit, dumps its stacks to <run_dir>/stacks/ and exits 124, torchrun restarts the job, and the
  resume is bitwise equal to the run never interrupted."""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fntrain import TrainState
from fntrain.checkpoint import SaveTarget, find_latest, resolve_source, restore, save, step_dir
from fntrain.runtime.restart import RESTART_HINT, attempt_store, note_restart_hint
from tests.checkpoint import toy
from tests.helpers.ports import free_port
from tests.helpers.runs import recorded_losses
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]


def test_auto_without_a_checkpoint_starts_fresh_quietly(tmp_path, caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would fail here
        with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
            assert restore("auto", toy.components(), root=tmp_path / "none_yet") == TrainState()
    assert "no complete checkpoint" in caplog.text  # an INFO line, not a warning
    with pytest.warns(UserWarning, match="no complete checkpoint"):  # "latest" still warns
        assert restore("latest", toy.components(), root=tmp_path / "none_yet") == TrainState()


def test_auto_restores_the_latest_complete_checkpoint(tmp_path):
    parts = toy.components()
    for step in (2, 4):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step))
    (step_dir(tmp_path, 6)).mkdir()  # a partial save left by a crash: ignored and cleaned
    assert resolve_source("auto", tmp_path) == step_dir(tmp_path, 4) == find_latest(tmp_path)
    assert restore("auto", toy.components(seed=5), root=tmp_path) == TrainState(0, 4, 4)
    assert not step_dir(tmp_path, 6).exists()


def test_auto_needs_the_root():
    with pytest.raises(ValueError, match='restore "auto" needs the checkpoint root'):
        restore("auto", toy.components())


AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"}


def test_one_node_scopes_the_agent_store_by_attempt():
    """torchrun keeps one store for every attempt; on one node the workers' keys go under the restart
    count, so a restarted worker never reads its predecessors' addresses."""
    port = free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    env = {**AGENT, "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    store = attempt_store(datetime.timedelta(seconds=10), 1, env)
    store.set("rank_0", "address")
    assert server.get("fntrain/attempt_1/rank_0") == b"address"
    assert (
        attempt_store(datetime.timedelta(seconds=10), 0, {**env, "LOCAL_WORLD_SIZE": "1"}) is None
    )  # 2 nodes
    assert (
        attempt_store(datetime.timedelta(seconds=10), 0, {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"})
        is None
    )


def test_restart_hint_for_a_restarted_worker_of_several_nodes():
    error = RuntimeError("connectFullMesh failed")
    env = {**AGENT, "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    note_restart_hint(error, 0, env)
    note_restart_hint(error, 1, {**env, "LOCAL_WORLD_SIZE": "16"})
    assert not getattr(error, "__notes__", None)  # first attempt, or one node (scoped by fntrain)
    note_restart_hint(error, 1, env)
    if sys.version_info >= (3, 11):
        assert error.__notes__ == [RESTART_HINT]
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in RESTART_HINT


# ----------------------------------------------------------------------------- torchrun --max-restarts


STEPS = 10
FLOOR_S = 6.0  # the frozen-rank job's watchdog limit (grace_s 0: no start-up grace); production keeps 600 s
POLL_S = 0.25
# factor 1: the limit is the floor unless a step takes longer (10 x the median step reached 11.6 s on two
# loaded cores, and the limit the dump states is checked below).
WATCHDOG = ["--watchdog.floor-s", str(FLOOR_S), "--watchdog.grace-s", "0", "--watchdog.poll-s", str(POLL_S),
            "--watchdog.factor", "1"]  # fmt: skip


def torchrun_restarting(
    run_dir: Path,
    fault: str,
    corpus: Path,
    restarts: int,
    agent: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """tests/run/fault_driver.py under torchrun (2 DDP ranks, c10d rendezvous): torchrun's options `agent`,
    the recipe's `extra`; `fresh`: new interpreters, not forks of the preloaded one (a SIGSTOPped rank
    must be the process torchrun stops and kills, not a fork behind its launcher)."""
    port = free_port()
    python = sys.executable if fresh else str(PYTHON.get("executable", sys.executable))
    command = [
        python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"restart{port}", *agent,
        "-m", "tests.run.fault_driver", str(run_dir), fault, "--run-dir", str(run_dir),
        "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
        "--model.dropout", "0.1",
        "--train.global-batch-size", "8", "--train.micro-batch-size", "2", "--train.train-iters", str(STEPS),
        "--log-every", "0", "--data.path", str(corpus), "--parallel.strategy", "ddp", "--progress.no-enabled",
        "--checkpoint.save-every", "2", "--checkpoint.restore-from", "auto", *extra,
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.update({} if fresh else PYTHON.get("env", {}))
    # torchrun's default: one rendezvous store shared by every attempt (setup_runtime scopes the keys).
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    what = f"the 2-rank torchrun run in {run_dir.name} with fault {fault} and up to {restarts} restart(s)"
    return run_to_end(command, what, 300, cwd=ROOT, env=env)


# The slow tests' torchrun and its workers are forks of one process that imported torch and fntrain once
# (tests/helpers/fork_server.py), set up for the module by the `module_launches_forked` fixture (tests/conftest.py).
PYTHON: dict[str, object] = {}


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, corpus, module_launches_forked) -> Path:
    """The uninterrupted run both restarted jobs must end as (the watchdog settings change no step)."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = torchrun_restarting(run_dir, "none", corpus, restarts=0)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


def assert_same_run_after_restart(reference: Path, run_dir: Path) -> None:
    """Rank 0 recorded every step exactly once (the restarted job resumed from step 4's checkpoint after
    a fault at step 5, before step 5 completed anywhere), each loss and the final weights equal to the
    reference's."""
    expected, recorded = dict(recorded_losses(reference)), recorded_losses(run_dir)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert [step for step, _ in recorded] == list(range(1, STEPS + 1)), recorded
    assert all(value == expected[step] for step, value in recorded), "losses differ from the reference"
    want, got = load_file(reference / "model.safetensors"), load_file(run_dir / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.slow
def test_torchrun_restart_after_a_crash_on_rank_1_matches_an_uninterrupted_run(tmp_path, corpus, uninterrupted_run):
    run_dir = tmp_path / "run"
    result = torchrun_restarting(run_dir, "crash:1:5", corpus, restarts=1)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "injected crash on rank 1 at step 5" in output  # it did crash, and torchrun restarted it
    assert_same_run_after_restart(uninterrupted_run, run_dir)

    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    assert metadata["restart_count"] == 1 and [
        launch["restart_count"] for launch in metadata["launches"]
    ] == [0, 1]
    assert metadata["launches"][-1]["start_step"] == 4 and metadata["start_state"]["global_step"] == 4
    log_text = (run_dir / "logs" / "rank_1.log").read_text()
    assert "injected crash on rank 1" in log_text and "restart 1" in log_text


@pytest.mark.slow
def test_a_frozen_worker_is_found_by_the_healthy_rank_restarted_and_resumed_bitwise(
    tmp_path, corpus, uninterrupted_run
):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = torchrun_restarting(
        run_dir, "sigstop:1:5", corpus, restarts=2, agent=("--shutdown-timeout", "5"), extra=tuple(WATCHDOG),
        fresh=True,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert time.monotonic() - started < 200  # a hang, found: not a collective timeout (1800 s)

    # The healthy rank's watchdog fired within its limit and said where the stacks are.
    assert "watchdog: rank 0: no progress for" in output and "exit status 124" in output, output[-6000:]
    dump = (run_dir / "stacks" / "rank_0.txt").read_text()
    header = re.search(r"=== fntrain watchdog, rank 0, pid \d+, [^:]+:\d+:\d+: no progress for ([\d.]+) s "
                       r"inside step 5 \(limit ([\d.]+) s", dump)  # fmt: skip
    assert header is not None, dump[:2000]
    silence, limit = float(header.group(1)), float(header.group(2))
    # Found within the limit: past it (the dump rounds to 0.1 s, so a silence of 6.04 s reads 6.0), within
    # a few polls.
    assert limit == FLOOR_S and FLOOR_S <= silence <= FLOOR_S + 4 * POLL_S + 2.0
    assert "Thread" in dump and "File " in dump  # every thread's Python stack, the main thread's included
    marker = json.loads((run_dir / "stacks" / "HANG").read_text())
    assert marker["rank"] == 0 and "inside step 5" in marker["reason"]

    # torchrun restarted the job, which resumed from step 4's checkpoint, bit for bit.
    assert_same_run_after_restart(uninterrupted_run, run_dir)
    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    assert metadata["restart_count"] >= 1 and metadata["launches"][-1]["start_step"] == 4
