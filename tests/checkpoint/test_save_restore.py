"""save / save_async / restore [S36]: exact continuation, contents, no pickle, restore rules and errors."""

from __future__ import annotations

import json
import logging
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fntrain.checkpoint import (
    MissingKeysError,
    SaveOptions,
    SaveTarget,
    find_latest,
    is_complete,
    read_meta,
    restore,
    save,
    save_async,
    step_dir,
)
from fntrain.checkpoint.layout import DCP_METADATA, LATEST, MARKER
from fntrain.checkpoint.safe_reader import read_dcp_metadata
from fntrain.checkpoint.verify import CheckpointDamagedError, write_manifest
from fntrain.hooks.base import stateful
from fntrain.loop import Event
from fntrain.state import TrainState
from tests.checkpoint import toy


def counter_hook(name: str = "counter", start: int = 0):
    box = {"count": start}

    def fn(event, state, info):
        if event is Event.STEP_END:
            box["count"] += 1

    def load(saved):
        box["count"] = saved["count"]

    return stateful(name, fn, lambda: dict(box), load), box


def test_restore_continues_bit_for_bit(tmp_path):
    """Saved after 3 steps and restored into fresh objects (different init and RNG): the next steps'
    losses are == and the weights torch.equal to the run that never stopped (dropout draws included)."""
    data = toy.batches(7)
    live = toy.components(seed=0)
    torch.manual_seed(5)
    for ids in data[:3]:
        toy.step(live, ids)
    save(SaveTarget(tmp_path, live), TrainState(0, 3, 3))
    expected = [toy.step(live, ids) for ids in data[3:]]

    fresh = toy.components(seed=123)  # other weights, an optimizer with no state yet
    torch.manual_seed(777)  # other RNG state
    state = restore("latest", fresh, root=tmp_path)
    assert state == TrainState(0, 3, 3)
    assert [toy.step(fresh, ids) for ids in data[3:]] == expected
    assert toy.same_weights(live, fresh)
    assert fresh.schedulers[0].last_epoch == live.schedulers[0].last_epoch
    assert fresh.optimizers[0].param_groups[0]["lr"] == live.optimizers[0].param_groups[0]["lr"]
    assert isinstance(fresh.optimizers[0].param_groups[0]["betas"], tuple)  # JSON lists become tuples again


def test_layout_and_contents_are_tensors_and_json(tmp_path):
    parts = toy.components()
    toy.step(parts, toy.batches(1)[0])
    hook, _ = counter_hook()
    path = save(
        SaveTarget(tmp_path, parts, hooks=[hook], config={"lr": 0.01, "name": "toy"}),
        TrainState(1, 5, 2),
        SaveOptions(keep_last=3),
    )
    assert path == step_dir(tmp_path, 5) and is_complete(path)
    assert (tmp_path / LATEST).read_text().strip() == "step_5"
    names = sorted(p.name for p in path.iterdir())
    assert names == [DCP_METADATA, MARKER, "__0_0.distcp", "manifest.json", "meta.json", "rank_0.json"]
    meta = read_meta(path)
    assert meta["train_state"] == {"epoch": 1, "global_step": 5, "cursor": 2}
    assert meta["config"] == {"lr": 0.01, "name": "toy"}
    assert meta["world_size"] == 1 and meta["num_threads"] == torch.get_num_threads()
    rank = json.loads((path / "rank_0.json").read_text())
    assert set(rank["rng"]) == {"python", "numpy", "torch_cpu"}
    assert rank["hooks"] == {"counter": {"count": 0}}
    keys = set(read_dcp_metadata(path).state_dict_metadata)
    assert {"model.embed.weight", "model.head.weight", "optimizer.state.hidden.weight.exp_avg"} <= keys
    assert {"optimizer.state.hidden.weight.step"} <= keys
    assert all(key.split(".")[0] in ("model", "optimizer") for key in keys)  # only tensors went to DCP
    # Non-tensor state lives in JSON: the optimizer's hyperparameters and the schedule.
    values = {tuple(p): v for p, v in meta["values"]}
    assert values[("optimizer", "param_groups", 0, "weight_decay")] == 0.1
    assert values[("schedulers", 0, "last_epoch")] == 1


def test_metadata_reader_refuses_foreign_globals(tmp_path):
    """DCP's .metadata is a pickle; a crafted one must not run code on restore."""
    parts = toy.components()
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / DCP_METADATA).write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointDamagedError, match="metadata: truncated"):  # the manifest sees it first
        restore(path, toy.components())
    write_manifest(path)  # whoever crafts a checkpoint can write its manifest too
    with pytest.raises(pickle.UnpicklingError, match="not a DCP metadata type"):
        restore(path, toy.components())
    (path / "manifest.json").unlink()  # without a manifest the legacy checks read .metadata safely too
    with pytest.raises(CheckpointDamagedError, match="not a DCP metadata type"):
        restore(path, toy.components())
    assert not marker.exists()


def test_explicit_path_rules(tmp_path):
    parts = toy.components()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        restore(tmp_path / "nope", parts)
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    (path / MARKER).unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint.*COMPLETE"):
        restore(path, parts)
    assert restore("none", parts) == TrainState()
    assert restore(None, parts) == TrainState()


def test_explicit_path_to_a_checkpoint_root_means_its_latest(tmp_path):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4))
    assert restore(tmp_path, toy.components()) == TrainState(0, 4, 4)
    with pytest.raises(ValueError, match="needs the checkpoint root"):
        restore("latest", parts)


def test_latest_without_checkpoints_starts_fresh_with_a_warning(tmp_path):
    parts = toy.components()
    before = toy.weights(parts)
    with pytest.warns(UserWarning, match="no complete checkpoint"):
        assert restore("latest", parts, root=tmp_path / "empty") == TrainState()
    assert toy.same_weights(parts, parts) and all(
        torch.equal(before[k], v) for k, v in toy.weights(parts).items()
    )
    assert not parts.optimizers[0].state  # nothing initialised


def test_latest_ignores_and_cleans_partials(tmp_path):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    partial = save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4))
    (partial / MARKER).unlink()  # as if killed between .metadata and the marker
    (tmp_path / LATEST).write_text("step_4\n")
    assert restore("latest", toy.components(), root=tmp_path) == TrainState(0, 2, 2)
    assert not partial.exists()


def test_missing_model_keys_name_them(tmp_path):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    bigger = toy.components(extra=True)
    with pytest.raises(MissingKeysError, match=r"extra\.bias, extra\.weight"):
        restore(path, bigger)
    with pytest.raises(KeyError):  # still a KeyError for callers that catch that
        restore(path, bigger)


def test_shape_mismatch_names_the_key(tmp_path):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    torch.manual_seed(0)
    other = toy.Toy(width=4)
    with pytest.raises(ValueError, match=r"model\.embed\.weight has shape \(16, 8\)"):
        restore(path, toy.Components(other, None, ()))


def test_unexpected_model_keys_warn(tmp_path, caplog):
    path = save(SaveTarget(tmp_path, toy.components(extra=True, optimizer=False)), TrainState(0, 1, 1))
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        restore(path, toy.components(optimizer=False))
    assert "extra.weight" in caplog.text


def test_missing_optimizer_state_warns_and_keeps_a_fresh_optimizer(tmp_path):
    source = toy.components(optimizer=False)
    path = save(SaveTarget(tmp_path, source), TrainState(0, 3, 3))
    target = toy.components(seed=9)
    with pytest.warns(UserWarning) as caught:
        assert restore(path, target) == TrainState(0, 3, 3)
    messages = [str(w.message) for w in caught]
    assert any("no optimizer state" in m for m in messages) and any(
        "no schedulers state" in m for m in messages
    )
    assert toy.same_weights(source, target)
    assert not target.optimizers[0].state  # truly fresh: no zero-lr initialisation step left behind


def test_restores_warnings_point_at_its_caller(tmp_path):
    path = save(SaveTarget(tmp_path, toy.components(optimizer=False)), TrainState(0, 3, 3))
    with pytest.warns(UserWarning) as caught:
        restore(path, toy.components(seed=9))
    assert caught and all(w.filename == __file__ for w in caught)


def test_changed_parameter_groups_warn(tmp_path):
    source = toy.components()
    toy.step(source, toy.batches(1)[0])
    path = save(SaveTarget(tmp_path, source), TrainState(0, 1, 1))
    target = toy.components()
    params = list(target.model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    target = toy.Components(target.model, None, (opt,))
    with pytest.warns(UserWarning, match="parameter groups differ"):
        restore(path, target)
    assert toy.same_weights(source, target)


def test_weights_only(tmp_path):
    source = toy.components()
    for ids in toy.batches(2):
        toy.step(source, ids)
    path = save(SaveTarget(tmp_path, source), TrainState(0, 2, 2))
    target = toy.components(seed=4)
    assert restore(path, target, weights_only=True) == TrainState()
    assert toy.same_weights(source, target)
    assert not target.optimizers[0].state
    assert target.schedulers[0].last_epoch == 0


def test_hook_state_round_trip_and_missing_hook_warns(tmp_path, caplog):
    hook, box = counter_hook(start=41)
    path = save(SaveTarget(tmp_path, toy.components(), hooks=lambda: [hook]), TrainState(0, 1, 1))
    restored_hook, restored_box = counter_hook(start=0)
    newcomer, _ = counter_hook(name="newcomer")
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        restore(path, toy.components(), hooks=[restored_hook, newcomer])
    assert restored_box == {"count": 41} == box
    assert "newcomer" in caplog.text


def test_hook_state_must_be_json(tmp_path):
    bad = stateful("bad", lambda *a: None, lambda: {"t": object()}, lambda s: None)
    with pytest.raises(TypeError, match="hook 'bad' must be JSON"):
        save(SaveTarget(tmp_path, toy.components(), hooks=[bad]), TrainState(0, 1, 1))


def test_thread_count_mismatch_is_reported(tmp_path, caplog):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    meta = json.loads((path / "meta.json").read_text())
    meta["num_threads"] = torch.get_num_threads() + 1
    (path / "meta.json").write_text(json.dumps(meta))
    write_manifest(path)  # an edit that keeps the checkpoint consistent
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        restore(path, toy.components())
    assert "get_num_threads" in caplog.text


def test_saving_a_step_again_replaces_it(tmp_path):
    parts = toy.components()
    first = save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    (first / "stale.txt").write_text("from an earlier attempt")
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert not (first / "stale.txt").exists() and is_complete(first)


def test_async_save_snapshots_the_state_at_the_call(tmp_path):
    parts = toy.components()
    data = toy.batches(3)
    toy.step(parts, data[0])
    snapshot = toy.components(seed=1)
    snapshot.model.load_state_dict(parts.model.state_dict())
    pending = save_async(SaveTarget(tmp_path, parts), TrainState(0, 1, 1), SaveOptions(keep_last=1))
    toy.step(parts, data[1])  # training moves on while the save is written
    assert pending.result() == step_dir(tmp_path, 1)
    assert is_complete(pending.path) and find_latest(tmp_path) == pending.path
    target = toy.components(seed=2)
    restore("latest", target, root=tmp_path)
    assert toy.same_weights(target, snapshot)


def test_failed_async_save_raises_and_is_never_complete(tmp_path, monkeypatch):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))

    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken)
    pending = save_async(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    with pytest.raises(RuntimeError, match="checkpoint step_2 not saved: disk full"):
        pending.result()
    assert not is_complete(step_dir(tmp_path, 2))
    assert find_latest(tmp_path) == step_dir(tmp_path, 1)
    assert (tmp_path / LATEST).read_text().strip() == "step_1"


def test_pending_stop_never_raises(tmp_path, monkeypatch):
    parts = toy.components()

    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken)
    pending = save_async(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pending.stop(timeout=30) is False
    monkeypatch.undo()
    ok = save_async(SaveTarget(tmp_path, parts), TrainState(0, 3, 3))
    assert ok.stop(timeout=30) is True and is_complete(ok.path)
