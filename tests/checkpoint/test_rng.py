"""RNG state capture/restore per rank: python, numpy, torch CPU and the device, as plain JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from fntrain.checkpoint.rng import rng_state, set_rng_state


def global_rng_draws() -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(),
        torch.rand(4).tolist(),
    )


def test_round_trip_through_json_replays_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.randn()  # and numpy's
    saved = json.loads(json.dumps(rng_state("cpu")))
    expected = global_rng_draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    set_rng_state(saved, "cpu")
    assert global_rng_draws() == expected


def test_no_device_entry_on_cpu():
    assert "device" not in rng_state("cpu")


def test_device_state_saved_and_restored_per_device(monkeypatch):
    states = {0: torch.arange(8, dtype=torch.uint8), 1: torch.arange(8, 16, dtype=torch.uint8)}
    restored = {}
    # A stand-in for the device module (torch.cuda here; torch.npu once torch_npu is imported).
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda index: states[index].clone())
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, index: restored.__setitem__(index, state.clone())
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    saved = json.loads(json.dumps(rng_state(torch.device("cuda", 0))))
    assert saved["device"]["type"] == "cuda"
    set_rng_state(saved, torch.device("cuda", 0))
    assert torch.equal(restored[0], states[0])
    set_rng_state(json.loads(json.dumps(rng_state("cuda"))), "cuda")  # no index: the current device
    assert torch.equal(restored[1], states[1])
    restored.clear()
    set_rng_state(saved, "cpu")  # a device state never goes to another device type
    assert restored == {}


def test_device_without_rng_api_is_an_error():
    with pytest.raises(RuntimeError, match="no RNG state API"):
        rng_state(torch.device("meta"))
