"""GC [S33]: collection cadence, device cache cadence (not on cpu), automatic gc off during training."""

from __future__ import annotations

import gc

import pytest
import torch

from fntrain.hooks import gc as gc_module
from fntrain.hooks.gc import GCConfig, gc_hook
from fntrain.loop import Event
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from tests.hooks.drive import drive, state_at


@pytest.fixture
def automatic_gc_restored():
    was_enabled = gc.isenabled()
    yield
    (gc.enable if was_enabled else gc.disable)()


def test_collects_every_n_steps_with_the_configured_generation(monkeypatch):
    collected = []
    monkeypatch.setattr(gc_module.gc, "collect", lambda generation=2: collected.append(generation))
    drive(gc_hook(GCConfig(gc_every=3, generation=1), Runtime()), 10, end=None)
    assert collected == [1, 1, 1]  # steps 3, 6, 9


def test_never_collects_by_default(monkeypatch):
    collected = []
    monkeypatch.setattr(gc_module.gc, "collect", lambda generation=2: collected.append(generation))
    drive(gc_hook(GCConfig(), Runtime()), 10, end=None)
    assert collected == []


def test_empty_cache_every_n_steps_on_an_accelerator_only(monkeypatch):
    emptied = []
    monkeypatch.setattr(gc_module, "_empty_cache_fn", lambda device: lambda: emptied.append(device.type))
    drive(gc_hook(GCConfig(empty_cache_every=2), Runtime(device=torch.device("cuda", 0))), 5, end=None)
    assert emptied == ["cuda", "cuda"]  # steps 2 and 4
    emptied.clear()
    drive(gc_hook(GCConfig(empty_cache_every=2), Runtime()), 5, end=None)
    assert emptied == []  # cpu has no caching allocator


@pytest.mark.parametrize("end", [Event.TRAIN_END, Event.ABORT])
def test_automatic_gc_off_during_training_and_back_on_after(end, automatic_gc_restored):
    gc.enable()
    hook = gc_hook(GCConfig(gc_every=5, disable_automatic=True), Runtime())
    assert gc.isenabled()  # built: nothing changed yet
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    assert not gc.isenabled()
    hook(end, state_at(1), RuntimeError("boom") if end is Event.ABORT else None)
    assert gc.isenabled()


def test_gc_the_user_had_disabled_stays_disabled(automatic_gc_restored):
    gc.disable()
    hook = gc_hook(GCConfig(gc_every=5, disable_automatic=True), Runtime())
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    hook(Event.TRAIN_END, state_at(1), None)
    assert not gc.isenabled()


def test_abort_before_train_begin_changes_nothing(automatic_gc_restored):
    gc.disable()
    hook = gc_hook(GCConfig(disable_automatic=True, gc_every=1), Runtime())
    hook(Event.ABORT, TrainState(), RuntimeError("boom"))
    assert not gc.isenabled()


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="gc.gc_every"):
        GCConfig(gc_every=-1).validate()
    with pytest.raises(ValueError, match="gc.generation"):
        GCConfig(generation=3).validate()
    with pytest.raises(TypeError, match="gc.disable_automatic"):
        gc_hook(GCConfig(disable_automatic="yes"), Runtime())
