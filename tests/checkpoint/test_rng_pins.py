"""Pins for fntrain/checkpoint/rng.py that mutation testing showed unpinned: the defaults a caller
without a device gets, and the refusal of a device type without an RNG state API."""

from __future__ import annotations

import json
import random
import types

import numpy as np
import pytest
import torch

from fntrain.checkpoint.rng import rng_state, set_rng_state


def test_the_default_device_is_the_cpu_and_a_snapshot_round_trips_through_json():
    saved = json.loads(json.dumps(rng_state()))  # no device given: the CPU generators only
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.random(), np.random.rand(), torch.rand(())  # move every generator on
    set_rng_state(saved)  # no device given either
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_a_device_type_whose_torch_module_has_no_rng_api_is_refused(monkeypatch):
    monkeypatch.setattr(torch, "xla", types.SimpleNamespace(), raising=False)  # a module without get_rng_state
    with pytest.raises(RuntimeError, match=r"no RNG state API for device type 'xla' \(torch.xla.get_rng_state\)"):
        rng_state("xla")
