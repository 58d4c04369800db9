"""setup_runtime: seeding and the single-process runtime (the distributed runtime extends this)."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fntrain.config import require_bool, require_choice, require_int
from fntrain.runtime.runtime import Runtime

__all__ = ["RuntimeConfig", "setup_runtime", "seed_everything"]


@dataclass(frozen=True)
class RuntimeConfig:
    """Process runtime settings."""

    device: str = "cpu"
    """cpu, cuda, npu or auto (the best available)."""
    seed: int = 42
    """Seed for python, numpy and torch (42 when not configured) [S2]."""
    deterministic: bool = False
    """Full determinism: deterministic algorithms, cuBLAS workspace config, cuDNN deterministic [S3]."""

    def validate(self, prefix: str = "runtime") -> None:
        require_choice(f"{prefix}.device", self.device, ("cpu", "cuda", "npu", "auto"))
        require_int(f"{prefix}.seed", self.seed, min=0)
        require_bool(f"{prefix}.deterministic", self.deterministic)


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def setup_runtime(config: RuntimeConfig) -> Iterator[Runtime]:
    """Seed the process and yield its `Runtime`."""
    config.validate()
    seed_everything(config.seed, config.deterministic)
    yield Runtime(device=torch.device("cpu" if config.device == "auto" else config.device), seed=config.seed)
