"""The checkpoint's state-tree flattening (`fntrain.checkpoint.tree`: keys, JSON leaves, collisions,
non-finite floats) and its process-group facts (`fntrain.checkpoint._dist`) without and with a 1-rank
gloo group, including rank 0's text broadcast over a subgroup."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fntrain.checkpoint import _dist
from fntrain.checkpoint.tree import decode_value, json_leaf, rebuild, split


def test_tensors_and_json_values_are_split_by_path():
    weight = torch.ones(2)
    tensors, values = split({"model": {"w": weight}, "sched": [{"lr": np.float32(0.5)}, ("x", None)]})
    assert tensors == {"model.w": weight} and tensors["model.w"] is weight
    assert values == [[["sched", 0, "lr"], 0.5], [["sched", 1, 0], "x"], [["sched", 1, 1], None]]
    assert rebuild({"a": (1, [2])}, lambda path, leaf: (path, leaf)) == {
        "a": ((("a", 0), 1), [(("a", 1, 0), 2)])
    }


def test_non_finite_floats_survive_json():
    _, values = split({"best": math.inf, "worst": -math.inf, "none": math.nan, "ok": 1.5})
    encoded = {path[0]: value for path, value in values}
    assert encoded["best"] == {"float": "inf"} and encoded["ok"] == 1.5
    decoded = {name: decode_value(value) for name, value in encoded.items()}
    assert decoded["best"] == math.inf and decoded["worst"] == -math.inf and math.isnan(decoded["none"])
    assert decode_value({"float": "1.0", "other": 2}) == {"float": "1.0", "other": 2}


def test_bad_trees_are_refused_naming_the_place():
    with pytest.raises(TypeError, match=r"state key 3 at model.layers must be a str"):
        split({"model": {"layers": {3: torch.ones(1)}}})
    with pytest.raises(TypeError, match=r"state key 1 at <root> must be a str"):
        split({1: 2})
    with pytest.raises(TypeError, match=r"checkpoint state 'extra.fn' holds a set; only tensors and JSON"):
        split({"extra": {"fn": {1, 2}}})
    with pytest.raises(TypeError, match=r"'v' holds a ndarray"):
        json_leaf(("v",), np.zeros(2))  # an array, not a numpy scalar
    with pytest.raises(ValueError, match=r"two state entries flatten to the same checkpoint key 'a.b'"):
        split({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})


def test_process_group_facts_without_a_group():
    assert not _dist.initialized()
    assert (_dist.rank(), _dist.world_size(), _dist.broadcast_text("x")) == (0, 1, "x")
    _dist.barrier()  # no group: nothing to wait for


def test_process_group_facts_under_a_one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        assert _dist.initialized() and (_dist.rank(sub), _dist.world_size(sub)) == (0, 1)
        _dist.barrier(sub)
        assert _dist.broadcast_text("step_4") == "step_4"
        assert _dist.broadcast_text(None, sub) is None
        assert _dist.broadcast_text("ok", sub) == "ok"
    finally:
        dist.destroy_process_group()
