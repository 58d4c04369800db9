"""A worker restarted by torchrun (`--max-restarts`): its rendezvous keys scoped by the restart count on
one node, and a hint on the failed process-group init where fntrain cannot scope them (several nodes).

torchrun (torch >= 2.4) keeps one TCPStore for all attempts of a job and no longer scopes the workers'
keys by attempt, so a restarted worker can read its dead predecessors' addresses and fail to form the
process group (pytorch/pytorch#135712). The restart count comes from `LaunchEnv.restart_count`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = ["RESTART_HINT", "attempt_store", "note_restart_hint"]

# The setup's logger, as before the split: its records keep their logger name.
log = logging.getLogger("fntrain.runtime.setup")

RESTART_HINT = (
    "this process was restarted by torchrun, which shares one rendezvous store between attempts and "
    "keeps the previous attempt's keys (pytorch/pytorch#135712); across several nodes, run torchrun "
    "with --rdzv-backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
)


def attempt_store(
    timeout: datetime.timedelta, restart_count: int, env: Mapping[str, str] | None = None
) -> Any:
    """On one node under torchrun's shared agent store, a client of that store whose keys are scoped by
    `restart_count`; else None (the env:// rendezvous as usual).

    With a single agent the restart count is the same for every worker and scopes them safely; across
    nodes the agents count restarts independently, so there the store is left alone (see RESTART_HINT).
    """
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    world, local_world = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    if not world or world != local_world:
        return None
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(world), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"fntrain/attempt_{restart_count}", store)


def note_restart_hint(error: BaseException, restart_count: int, env: Mapping[str, str] | None = None) -> None:
    """Add `RESTART_HINT` to a failed process-group init of a restarted worker (`restart_count` > 0)
    that uses the agent's store across several nodes (the exception keeps its type)."""
    env = os.environ if env is None else env
    several_nodes = env.get("WORLD_SIZE") != env.get("LOCAL_WORLD_SIZE")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if restart_count != 0 and agent_store and several_nodes and hasattr(error, "add_note"):
        error.add_note(RESTART_HINT)
        log.error("process-group init failed after a restart: %s", RESTART_HINT)
