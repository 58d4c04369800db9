"""Automatic restart: `restore("auto")` (latest if a complete checkpoint exists, else a quiet fresh
start), and in the slow tier `torchrun --max-restarts 1` with a crash injected on rank 1: the restarted
job resumes by itself and ends with the losses and weights of an uninterrupted run."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fntrain import TrainState
from fntrain.checkpoint import SaveTarget, find_latest, resolve_source, restore, save, step_dir
from fntrain.runtime.restart import RESTART_HINT, attempt_store, note_restart_hint
from tests.checkpoint import toy

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(run_dir: Path, fault: str, corpus: Path, restarts: int) -> subprocess.CompletedProcess:
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"restart{port}",
        "-m", "tests.fault_driver", str(run_dir), fault, "--run-dir", str(run_dir),
        "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
        "--model.dropout", "0.1",
        "--train.global-batch-size", "8", "--train.micro-batch-size", "2", "--train.train-iters", "12",
        "--log-every", "0", "--data.path", str(corpus), "--parallel.strategy", "ddp", "--progress.no-enabled",
        "--checkpoint.save-every", "2", "--checkpoint.restore-from", "auto",
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    # torchrun's default: one rendezvous store shared by every attempt (setup_runtime scopes the keys).
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def losses(run_dir: Path) -> list[tuple[int, str]]:
    words = (run_dir / "losses.txt").read_text().split()
    return [(int(step), value) for step, value in zip(words[::2], words[1::2], strict=True)]


@pytest.mark.slow
def test_torchrun_restart_after_a_crash_on_rank_1_matches_an_uninterrupted_run(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:1700])
    reference = torchrun(tmp_path / "reference", "none", corpus, restarts=0)
    assert reference.returncode == 0, reference.stderr[-4000:]
    run_dir = tmp_path / "run"
    result = torchrun(run_dir, "crash:1:5", corpus, restarts=1)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "injected crash on rank 1 at step 5" in output  # it did crash, and torchrun restarted it

    expected = dict(losses(tmp_path / "reference"))
    recorded = losses(run_dir)
    assert sorted(expected) == list(range(1, 13)) and {step for step, _ in recorded} == set(expected)
    assert all(value == expected[step] for step, value in recorded), "losses differ from the reference"
    # Rank 0 recorded steps 1-4, the crash struck before step 5 completed anywhere, and the restarted
    # job resumed from step 4's checkpoint: every step recorded exactly once.
    assert [step for step, _ in recorded] == list(range(1, 13))
    want, got = (
        load_file(tmp_path / "reference" / "model.safetensors"),
        load_file(run_dir / "model.safetensors"),
    )
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    assert metadata["restart_count"] == 1 and [
        launch["restart_count"] for launch in metadata["launches"]
    ] == [0, 1]
    assert metadata["launches"][-1]["start_step"] == 4 and metadata["start_state"]["global_step"] == 4
    log_text = (run_dir / "logs" / "rank_1.log").read_text()
    assert "injected crash on rank 1" in log_text and "restart 1" in log_text
