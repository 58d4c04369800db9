"""`Runtime`: what the rest of fntrain needs to know about the process it runs in (frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Runtime"]


@dataclass(frozen=True)
class Runtime:
    """Ranks, device and parallel sizes of this process. Constructible by keywords for tests.

    `dp_rank`/`dp_size` are this process's data-parallel coordinates (the data shard it reads),
    `tp_rank`/`pp_rank` its tensor-parallel rank and pipeline stage, `cp_rank` its context-parallel rank
    (which slice of each sequence it computes; the cp ranks of a dp group read the same data); the ep
    size is carried so hooks can report it. `mesh` is the DeviceMesh when one was built.
    `restart_count` is torchrun's restart count of this launch (`LaunchEnv.restart_count`: 0 on a job's
    first attempt and for a plain run), read once by `read_launch_env`.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    backend: str | None = None
    mesh: Any = None
    seed: int = 42
    parallel_mode: str = "none"
    restart_count: int = 0

    @property
    def distributed(self) -> bool:
        """True when a process group is in use (world_size > 1 or explicitly initialised)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0
