"""What the tests' worker processes (`python -m tests.<folder>.<name>_worker`, alone or under torchrun)
share: the environment they start in, and a parameter or gradient as one whole tensor, however it is sharded."""

from __future__ import annotations

import os
from pathlib import Path

import torch

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
