"""A frozen rank end to end: under `torchrun --max-restarts 2` with 2 workers, one worker is stopped
(SIGSTOP: every thread of it frozen, as a dead NFS mount or a debugger leaves a process). The healthy
rank's watchdog notices within its limit, dumps its stacks to <run_dir>/stacks/ and exits 124, torchrun
restarts the job, and the resume is bitwise equal to a run never interrupted. Slow tier (torchrun)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.test_restart import free_port, losses

ROOT = Path(__file__).resolve().parents[1]
FLOOR_S = 6.0  # the watchdog's limit here (grace_s 0: no start-up grace); production keeps 600 s
POLL_S = 0.25


def torchrun(run_dir: Path, fault: str, corpus: Path, restarts: int) -> subprocess.CompletedProcess:
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"frozen{port}", "--shutdown-timeout", "5",
        "-m", "tests.fault_driver", str(run_dir), fault, "--run-dir", str(run_dir),
        "--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
        "--model.dropout", "0.1",
        "--train.global-batch-size", "8", "--train.micro-batch-size", "2", "--train.train-iters", "10",
        "--log-every", "0", "--data.path", str(corpus), "--parallel.strategy", "ddp", "--progress.no-enabled",
        "--checkpoint.save-every", "2", "--checkpoint.restore-from", "auto",
        "--watchdog.floor-s", str(FLOOR_S), "--watchdog.grace-s", "0", "--watchdog.poll-s", str(POLL_S),
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_frozen_worker_is_found_by_the_healthy_rank_restarted_and_resumed_bitwise(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_bytes()[:1700])
    reference = torchrun(tmp_path / "reference", "none", corpus, restarts=0)
    assert reference.returncode == 0, reference.stderr[-4000:]

    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = torchrun(run_dir, "sigstop:1:5", corpus, restarts=2)
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
    assert limit == FLOOR_S and FLOOR_S < silence <= FLOOR_S + 4 * POLL_S + 2.0  # found within the limit
    assert "Thread" in dump and "File " in dump  # every thread's Python stack, the main thread's included
    marker = json.loads((run_dir / "stacks" / "HANG").read_text())
    assert marker["rank"] == 0 and "inside step 5" in marker["reason"]

    # torchrun restarted the job, which resumed from step 4's checkpoint, bit for bit.
    expected, recorded = dict(losses(tmp_path / "reference")), losses(run_dir)
    assert [step for step, _ in recorded] == list(range(1, 11)), recorded
    assert all(value == expected[step] for step, value in recorded), "losses differ from the reference"
    want, got = (
        load_file(tmp_path / "reference" / "model.safetensors"),
        load_file(run_dir / "model.safetensors"),
    )
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    metadata = json.loads((run_dir / "run_metadata.json").read_text())
    assert metadata["restart_count"] >= 1 and metadata["launches"][-1]["start_step"] == 4
