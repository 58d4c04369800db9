"""`read_launch_env`: what the launcher (torchrun) told this process, read from the environment once.

Every launcher variable the run needs is read here and nowhere else; later code consumes the
`LaunchEnv` record (or the `Runtime` built from it), never `os.environ`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchEnv", "read_launch_env", "env_int"]


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun) told this process; `launched` is False for a plain `python` run.
    `restart_count` is torchrun's TORCHELASTIC_RESTART_COUNT: 0 on a job's first attempt, n after the
    n-th restart by `--max-restarts` (0 for a plain run)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False
    restart_count: int = 0


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """The environment variable `name` as an integer; `default` when unset or empty; a ValueError naming
    the variable and its value otherwise."""
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and TORCHELASTIC_RESTART_COUNT as torchrun sets
    them (validated).

    A process is `launched` when RANK and WORLD_SIZE are both set; then MASTER_ADDR and MASTER_PORT
    must be set too (torchrun does; other launchers must).
    """
    env = os.environ if env is None else env
    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if has_rank != has_world:
        missing = "WORLD_SIZE" if has_rank else "RANK"
        raise ValueError(
            f"environment variable {missing} is not set but {'RANK' if has_rank else 'WORLD_SIZE'} is"
        )
    world_size = env_int(env, "WORLD_SIZE", 1)
    rank = env_int(env, "RANK", 0)
    local_world_size = env_int(env, "LOCAL_WORLD_SIZE", world_size)
    if local_world_size < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
    local_rank = env_int(env, "LOCAL_RANK", rank % local_world_size)
    if world_size < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"environment variable RANK must be in [0, {world_size}), got {rank}")
    if local_rank < 0:
        raise ValueError(f"environment variable LOCAL_RANK must be >= 0, got {local_rank}")
    restart_count = env_int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    if restart_count < 0:
        raise ValueError(f"environment variable TORCHELASTIC_RESTART_COUNT must be >= 0, got {restart_count}")
    if has_rank:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise ValueError(
                f"RANK/WORLD_SIZE are set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                "launch with torchrun, or set the rendezvous address yourself"
            )
    return LaunchEnv(
        rank, local_rank, world_size, local_world_size, launched=has_rank, restart_count=restart_count
    )
