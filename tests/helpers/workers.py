"""What the tests' worker processes (`python -m tests.<folder>.<name>_worker`, alone or under torchrun)
share: the environment they start in, and a parameter or gradient as one whole tensor, however it is sharded."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers.waiting import wait_for_end

ROOT = Path(__file__).resolve().parents[2]


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of `tensor` whole: a DTensor (FSDP2, tensor parallel) gathered from its shards."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def worker_env(**extra: str) -> dict[str, str]:
    """The environment to start a worker or a recipe in (alone or under torchrun): this process's, without
    the launch variables a test process may carry (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR), with the
    checkout first on PYTHONPATH (so `-m tests.…` imports), one torch thread, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_ranks(
    ranks: int,
    command_of_rank: Callable[[int], list[str]],
    env_of_rank: Callable[[int], dict[str, str]],
    what: str,
    timeout: float,
    logs: Path,
) -> None:
    """One process per rank, all started at once (they rendezvous), each one's stderr in
    `logs/rank_<r>.err`: wait for each (`wait_for_end`, naming the rank of `what`) and check it exited
    0 (its stderr's tail in the message). Whatever still runs when one fails is killed."""
    processes = []
    try:
        for rank in range(ranks):
            with (logs / f"rank_{rank}.err").open("w") as sink:
                processes.append(subprocess.Popen(command_of_rank(rank), cwd=ROOT, env=env_of_rank(rank), stderr=sink))
        for rank, process in enumerate(processes):
            err = logs / f"rank_{rank}.err"
            wait_for_end(process, f"rank {rank} of {what}", timeout, err.read_text)
            assert process.returncode == 0, f"rank {rank} of {what}: {err.read_text()[-3000:]}"
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
