"""Device transfer of nested batches: structure kept, non_blocking only host -> accelerator, pinning."""

from __future__ import annotations

from collections import namedtuple

import torch

from fntrain.data import device as device_module
from fntrain.data.device import can_pin_memory, pin_memory, to_device


class Recorded(torch.Tensor):
    """A tensor that records the keyword arguments of `.to` and `.pin_memory` calls made on it."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.calls.append(("to", args[1:], kwargs))
            return args[0]
        if func is torch.Tensor.pin_memory:
            cls.calls.append(("pin_memory", args[1:], kwargs))
            return args[0]
        if func is torch.Tensor.is_pinned:
            return False
        return super().__torch_function__(func, types, args, kwargs)


def recorded_tensor(*shape) -> Recorded:
    return torch.zeros(*shape).as_subclass(Recorded)


Pair = namedtuple("Pair", "ids mask")


def test_nested_structure_is_kept_and_every_tensor_moves():
    batch = [
        {"input_ids": torch.ones(2, 3), "extra": {"meta": [torch.zeros(1), "name", 3]}, "none": None},
        Pair(torch.ones(1), torch.zeros(1)),
    ]
    moved = to_device(batch, "meta")
    assert isinstance(moved, list) and isinstance(moved[1], Pair)
    assert moved[0]["input_ids"].device.type == "meta" and moved[0]["input_ids"].shape == (2, 3)
    assert moved[0]["extra"]["meta"][0].device.type == "meta"
    assert moved[0]["extra"]["meta"][1:] == ["name", 3] and moved[0]["none"] is None
    assert moved[1].ids.device.type == "meta"
    assert batch[0]["input_ids"].device.type == "cpu"  # the input is not modified


def test_a_tensor_already_on_the_device_is_kept_as_is():
    tensor = torch.ones(3)
    assert to_device({"x": tensor}, torch.device("cpu"))["x"] is tensor


def test_non_blocking_only_for_host_to_accelerator_copies(monkeypatch):
    Recorded.calls = []
    to_device({"a": recorded_tensor(2)}, "cuda")  # no copy happens: the recorder intercepts it
    to_device({"a": recorded_tensor(2)}, "cuda", non_blocking=False)
    to_device({"a": recorded_tensor(2)}, "cpu")
    assert [call[2]["non_blocking"] for call in Recorded.calls] == [True, False, False]
    assert [str(call[1][0]) for call in Recorded.calls] == ["cuda", "cuda", "cpu"]


def test_pinning_is_a_no_op_without_an_accelerator_and_pins_host_tensors_with_one(monkeypatch):
    batch = {"x": torch.ones(2)}
    if not can_pin_memory():
        assert pin_memory(batch)["x"] is batch["x"]
    monkeypatch.setattr(device_module, "can_pin_memory", lambda: True)
    Recorded.calls = []
    pinned = pin_memory([{"x": recorded_tensor(2), "n": 1, "meta": torch.ones(1, device="meta")}])
    assert [call[0] for call in Recorded.calls] == ["pin_memory"]  # the host tensor only, not the meta one
    assert pinned[0]["n"] == 1
