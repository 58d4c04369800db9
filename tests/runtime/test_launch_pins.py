"""Pins of fntrain/runtime/launch.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import pytest

from fntrain.runtime.launch import read_launch_env

RENDEZVOUS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0"}, "environment variable WORLD_SIZE is not set but RANK is"),
        ({"WORLD_SIZE": "2"}, "environment variable RANK is not set but WORLD_SIZE is"),
        ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_WORLD_SIZE": "1", **RENDEZVOUS}, "environment variable WORLD_SIZE must be >= 1, got 0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1", **RENDEZVOUS},
         "environment variable LOCAL_RANK must be >= 0, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "-1", **RENDEZVOUS},
         "environment variable TORCHELASTIC_RESTART_COUNT must be >= 0, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "2"},
         "RANK/WORLD_SIZE are set but MASTER_ADDR, MASTER_PORT are not: launch with torchrun, or set the rendezvous "
         "address yourself"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
         "RANK/WORLD_SIZE are set but MASTER_PORT is not: launch with torchrun, or set the rendezvous address yourself"),
    ],
)  # fmt: skip
def test_a_launch_environment_that_does_not_add_up_is_one_line_naming_the_variable(env, message):
    with pytest.raises(ValueError) as error:
        read_launch_env(env)
    assert str(error.value) == message


def test_the_local_rank_torchrun_sets_is_the_one_read():
    """LOCAL_RANK wins over rank % LOCAL_WORLD_SIZE (a launcher may number the local ranks otherwise)."""
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", **RENDEZVOUS}
    assert read_launch_env(env).local_rank == 1
