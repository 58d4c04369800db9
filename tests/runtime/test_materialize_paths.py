"""`fntrain.runtime.materialize` paths the model tests leave out: a Parameter subclass rebuilt on meta
with its attributes, materializing onto another device (real tensors move, None buffers are skipped,
a buffer shared by two modules stays shared), a replay plan without post_init, and init steps that see
full plain twins on the init device (a weight registered twice in one module made once) while the
parameters themselves stay where they live."""

from __future__ import annotations

import torch
from torch import nn

from fntrain.runtime.materialize import build_on_meta, init_weights, materialize, replay_plan


class Tagged(nn.Parameter):
    """A Parameter subclass carrying an attribute (as quantized or sharded parameter types do)."""

    def __new__(cls, data=None, requires_grad=True, tag=None):
        param = super().__new__(cls, data, requires_grad)
        param.tag = tag
        return param


class WithTagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Tagged(torch.ones(3), requires_grad=False, tag="int8")


def test_a_parameter_subclass_is_rebuilt_on_meta_with_its_attributes():
    module = build_on_meta(WithTagged)
    assert type(module.scale) is Tagged and module.scale.is_meta
    assert module.scale.tag == "int8" and not module.scale.requires_grad


def test_materialize_moves_real_tensors_and_keeps_shared_buffers_shared():
    shared = torch.arange(4.0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for layer in model:
        layer.register_buffer("table", shared)
    model[0].register_buffer("absent", None)
    weight = model[0].weight
    materialize(model, "meta")
    assert model[0].weight is weight and weight.is_meta  # the same object, swapped onto meta
    assert model[0].table is model[1].table and model[0].table.is_meta
    assert model[0].absent is None
    materialize(model, "meta")  # already there: nothing changes
    assert model[0].weight is weight


def test_a_replay_plan_without_post_init_resets_each_module_once():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.LayerNorm(3))
    assert [module for module, _ in replay_plan(model)] == [model[0], model[2]]


class TwiceRegistered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2, 2))
        self.alias = self.weight  # one tensor under two names


def test_init_steps_see_full_twins_on_the_init_device():
    module = build_on_meta(TwiceRegistered)
    seen = []

    def fill(m: nn.Module) -> None:
        seen.append((m.weight.device.type, m.weight is m.alias, m.weight.shape))
        m.weight.fill_(2.0)

    init_weights(module, [(module, fill)], init_device="cpu")
    assert seen == [("cpu", True, torch.Size([2, 2]))]  # one twin for both names, real storage
    assert module.weight.is_meta and module.weight is module.alias  # the parameters stay on meta
