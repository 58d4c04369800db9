"""Behaviours of the checkpoint saver that mutation testing found unpinned (mutation/RESULTS.md): what
meta.json, rank_<r>.json and the completion marker say, how a leftover step directory is treated, the
warnings about a short disk and failed clean-up, what ranks other than 0 write, and that a save
interrupted at any point leaves the previous checkpoint the one `latest` restores."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest
import torch

from fntrain.checkpoint import (
    SaveOptions,
    SaveTarget,
    find_latest,
    is_complete,
    read_meta,
    restore,
    save,
    space,
    step_dir,
)
from fntrain.checkpoint import saver as saver_module
from fntrain.checkpoint.layout import DCP_METADATA, LATEST, MARKER, list_checkpoints
from fntrain.checkpoint.saver import FORMAT_VERSION, CheckpointSaveError, finalize, writer
from fntrain.hooks.base import stateful
from fntrain.state import TrainState
from fntrain.step.components import Components
from tests.checkpoint import toy
from tests.helpers.checkpoints import bytes_under, fake_disk_capacity


def test_meta_rank_file_and_marker_say_what_was_saved(tmp_path):
    parts = toy.components()
    toy.step(parts, toy.batches(1)[0])
    before = time.time()
    path = save(
        SaveTarget(tmp_path, parts, config={"lr": 0.5}, recipe="recipes.tiny_gpt", data={"files": {"a": 1}}),
        TrainState(2, 7, 3),
        SaveOptions(temporary=True),
    )
    after = time.time()
    meta = read_meta(path)
    assert meta["format"] == FORMAT_VERSION == 1 and meta["step"] == 7
    assert meta["train_state"] == {"epoch": 2, "global_step": 7, "cursor": 3}
    assert meta["world_size"] == 1 and meta["config"] == {"lr": 0.5}
    assert meta["recipe"] == "recipes.tiny_gpt" and meta["data"] == {"files": {"a": 1}}
    assert meta["torch_version"] == torch.__version__ and meta["num_threads"] == torch.get_num_threads()
    assert before <= meta["saved_at"] <= after and meta["temporary"] is True
    assert meta["tied"] == [["embed.weight", "head.weight"]]
    marker = json.loads((path / MARKER).read_text())
    assert set(marker) == {"step", "train_state", "completed_at", "temporary"}
    assert (
        marker["step"] == 7 and marker["train_state"] == meta["train_state"] and marker["temporary"] is True
    )
    assert meta["saved_at"] <= marker["completed_at"] <= after
    rank = json.loads((path / "rank_0.json").read_text())
    assert rank["rank"] == 0 and rank["world_size"] == 1 and rank["hooks"] == {}
    assert len(rank["optimizer_groups"]) == 1 and len(rank["optimizer_groups"][0]) == 5  # tied: one entry
    plain = save(SaveTarget(tmp_path, parts), TrainState(2, 8, 4))
    meta = read_meta(plain)
    assert meta["config"] is None and meta["recipe"] is None and meta["data"] is None
    assert meta["temporary"] is False and json.loads((plain / MARKER).read_text())["temporary"] is False


def test_a_model_without_an_optimizer_or_on_a_named_device_saves_its_rng(tmp_path):
    path = save(SaveTarget(tmp_path, toy.components(optimizer=False)), TrainState(0, 1, 1))
    assert "optimizer_groups" not in json.loads((path / "rank_0.json").read_text())
    named = save(SaveTarget(tmp_path, toy.components(), device="cpu"), TrainState(0, 3, 3))
    assert set(json.loads((named / "rank_0.json").read_text())["rng"]) == {"python", "numpy", "torch_cpu"}


def test_hook_states_from_a_list_or_a_callable_and_a_non_json_state_is_named(tmp_path):
    one = stateful("one", lambda *a: None, lambda: {"n": 1}, lambda s: None)
    two = stateful("two", lambda *a: None, lambda: {"n": [2]}, lambda s: None)
    for hooks in ([one, two], lambda: [one, two]):
        path = save(SaveTarget(tmp_path, toy.components(), hooks=hooks), TrainState(0, 1, 1))
        assert json.loads((path / "rank_0.json").read_text())["hooks"] == {"one": {"n": 1}, "two": {"n": [2]}}
    loop: dict = {}
    loop["self"] = loop
    for state, reason in (({"t": object()}, "Object of type object is not JSON serializable"),
                          (loop, "Circular reference detected")):  # fmt: skip
        bad = stateful("bad", lambda *a: None, lambda state=state: state, lambda s: None)
        with pytest.raises(TypeError) as raised:
            save(SaveTarget(tmp_path, toy.components(), hooks=[bad]), TrainState(0, 2, 2))
        assert (
            str(raised.value)
            == f"the state_dict() of hook 'bad' must be JSON data (tensors: .tolist()): {reason}"
        )
        assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_a_leftover_step_directory_is_replaced_removed_or_moved_aside(tmp_path, caplog):
    parts = toy.components()
    path = step_dir(tmp_path, 2)
    path.mkdir(parents=True)  # empty: nothing to lose
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_2"]
    assert not any("moved" in m or "replacing" in m for m in caplog.messages)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert f"replacing existing checkpoint directory {path}" in caplog.messages
    (path / MARKER).unlink()  # an interrupted save's leftovers: kept, under another name
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert f"moved the incomplete checkpoint directory {path} aside to step_2.incomplete" in caplog.messages
    assert (tmp_path / "step_2.incomplete" / DCP_METADATA).is_file() and is_complete(path)
    assert saver_logs(caplog)[-1] == f"checkpoint saved: {path}"


def saver_logs(caplog) -> list[str]:
    """The checkpoint code's log lines (DCP logs its own events at DEBUG)."""
    return [record.getMessage() for record in caplog.records if record.name == "fntrain.checkpoint"]


def test_short_disk_warnings_name_the_sizes_and_what_make_room_removed(tmp_path, monkeypatch, caplog):
    parts = toy.components()
    one = bytes_under(save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1)))
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 3.5))  # 1.5 saves free: this one fits, the next would not
    free, needed = space.free_bytes(tmp_path), space.needed_bytes(tmp_path, {})  # the previous save's size
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 3, 3), SaveOptions(keep_last=3))
    assert saver_logs(caplog) == [
        f"checkpoint filesystem nearly full: {space.human_bytes(free)} free, step_3 needs "
        f"~{space.human_bytes(needed)}; the save after it will not fit unless space is freed"
    ]
    caplog.clear()
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 3.5))  # no room for step_4 until step_1 goes
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4), SaveOptions(keep_last=3, make_room=True))
    assert saver_logs(caplog)[0] == "checkpoint.make_room: removed step_1 to make room for step_4"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3", "step_4"]
    caplog.clear()
    used = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    fake_disk_capacity(monkeypatch, tmp_path, used + 2 * space.needed_bytes(tmp_path, {}))  # room for exactly two more
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 5, 5))
    assert saver_logs(caplog) == []


def test_a_save_into_a_root_that_does_not_exist_yet_is_checked_against_its_parent(tmp_path, monkeypatch):
    seen = []
    real = space.free_bytes
    monkeypatch.setattr(space, "free_bytes", lambda path: seen.append(path) or real(path))
    root = tmp_path / "runs" / "a" / "ckpt"
    path = save(SaveTarget(root, toy.components()), TrainState(0, 1, 1))
    assert is_complete(path) and (root / LATEST).read_text() == "step_1\n"

    monkeypatch.setattr(space, "free_bytes", lambda path: 0)
    for options in (SaveOptions(), SaveOptions(keep_last=2, make_room=True)):  # make_room: nothing to remove
        with pytest.raises(CheckpointSaveError) as raised:
            save(SaveTarget(tmp_path / "new" / "ckpt", toy.components()), TrainState(0, 1, 1), options)
        assert raised.value.line.startswith(f"checkpoint step_1 not saved: ENOSPC not enough free space on "
                                            f"{tmp_path} for step_1")  # the nearest directory that exists  # fmt: skip


def test_failed_clean_up_after_a_complete_save_is_a_warning_and_the_checkpoint_stays(
    tmp_path, monkeypatch, caplog
):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))

    def fails(root, keep_last, protect=None, keep_best=False):
        raise PermissionError(13, "Permission denied", str(root))

    monkeypatch.setattr(saver_module, "retain", fails)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        path = save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2), SaveOptions(keep_last=1))
    assert is_complete(path) and find_latest(tmp_path) == path
    *_, warning, saved = saver_logs(caplog)
    assert warning.startswith(f"checkpoint {path} saved, but removing older checkpoints failed: ")
    assert "Permission denied" in warning and saved == f"checkpoint saved: {path}"


def test_only_rank_zero_finalizes_and_discards(tmp_path, monkeypatch):
    parts = toy.components()
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    (path / MARKER).unlink()
    (tmp_path / LATEST).unlink()
    monkeypatch.setattr(saver_module._dist, "rank", lambda group=None: 1)
    assert finalize(tmp_path, path, TrainState(0, 1, 1), keep_last=1) is None
    assert not (path / MARKER).exists() and not (tmp_path / LATEST).exists()  # rank 0's work
    with pytest.raises(CheckpointSaveError) as raised:
        saver_module.raise_if_failed(tmp_path, path, 1, "EIO input/output error", None)
    assert raised.value.line.startswith("checkpoint step_1 not saved: EIO input/output error")
    assert (path / DCP_METADATA).is_file()  # another rank's partial is rank 0's to remove
    saver_module.raise_if_failed(tmp_path, path, 1, None, None)  # nothing failed: nothing raised


def test_another_rank_writes_only_its_own_rank_file(tmp_path, monkeypatch):
    parts = toy.components()
    path = step_dir(tmp_path, 4)
    path.mkdir(parents=True)
    monkeypatch.setattr(saver_module._dist, "rank", lambda group=None: 1)
    monkeypatch.setattr(saver_module._dist, "world_size", lambda group=None: 2)
    tree = saver_module.app_state(parts)
    _, values = saver_module.split(tree)
    saver_module._write_json_parts(
        path, TrainState(0, 4, 4), SaveTarget(tmp_path, parts), False, tree, values
    )
    assert sorted(p.name for p in path.iterdir()) == ["rank_1.json"]
    rank = json.loads((path / "rank_1.json").read_text())
    assert rank["rank"] == 1 and rank["world_size"] == 2


def test_the_writer_syncs_files_with_the_asked_thread_count(tmp_path):
    for count in (1, 3):
        made = writer(tmp_path, count)
        assert made.sync_files is True and made.thread_count == count
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1), SaveOptions(thread_count=2))
    assert len(list(path.glob("*.distcp"))) == 2


@pytest.mark.parametrize("stage", ["meta.json", "dcp", "manifest", "marker", "latest"])
def test_a_save_interrupted_at_any_point_leaves_the_previous_checkpoint_restored(
    tmp_path, monkeypatch, stage
):
    """The property the kill-and-resume tests check across processes, in one: whatever step of a save
    fails, `latest` still restores the previous checkpoint's exact weights and state."""
    parts = toy.components()
    toy.step(parts, toy.batches(1)[0])
    save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    expected = toy.weights(parts)
    toy.step(parts, toy.batches(2)[1])

    def boom(*args, **kwargs):
        raise OSError(5, "Input/output error")

    if stage == "meta.json":
        real = saver_module.write_json_atomic
        monkeypatch.setattr(saver_module, "write_json_atomic",
                            lambda p, payload: boom() if p.name == "meta.json" else real(p, payload))  # fmt: skip
    elif stage == "dcp":
        monkeypatch.setattr(saver_module.dcp, "save", boom)
    else:
        monkeypatch.setattr(saver_module, {"manifest": "write_manifest", "marker": "write_marker",
                                           "latest": "write_latest"}[stage], boom)  # fmt: skip
    needed = space.needed_bytes(tmp_path, {})
    with pytest.raises(CheckpointSaveError, match="^checkpoint step_2 not saved: EIO") as raised:
        save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert f" (needs ~{space.human_bytes(needed)}, " in raised.value.line  # the size it was writing
    monkeypatch.undo()
    assert not step_dir(tmp_path, 2).exists() and (tmp_path / LATEST).read_text() == "step_1\n"
    fresh = toy.components(seed=9)
    assert restore("latest", fresh, root=tmp_path) == TrainState(0, 1, 1)
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in expected.items())


def test_a_save_collects_over_the_process_group_it_is_given(tmp_path, monkeypatch):
    """A save over a subgroup (one pipeline stage's or replica's ranks) agrees and writes over that group
    only: every agreement and DCP's write get the group passed to `save`."""
    group = object()  # stands for a subgroup; in one process nothing is collective
    agreed, written = [], []
    real_save, real_agree = saver_module.dcp.save, saver_module._dist.agree

    def dcp_save(state, *, storage_writer, process_group, no_dist):
        written.append(process_group)
        return real_save(state, storage_writer=storage_writer, process_group=None, no_dist=no_dist)

    def agree(problem, process_group=None):
        agreed.append(process_group)
        return real_agree(problem, None)

    monkeypatch.setattr(saver_module.dcp, "save", dcp_save)
    monkeypatch.setattr(saver_module._dist, "agree", agree)
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1), process_group=group)
    assert is_complete(path)
    assert written == [group] and len(agreed) == 3 and all(g is group for g in agreed)


def test_under_a_process_group_dcp_writes_as_one_collective_checkpoint(tmp_path, monkeypatch):
    modes = []
    real_save = saver_module.dcp.save

    def dcp_save(state, *, storage_writer, process_group, no_dist):
        modes.append(no_dist)
        return real_save(state, storage_writer=storage_writer, process_group=None, no_dist=True)

    monkeypatch.setattr(saver_module.dcp, "save", dcp_save)
    save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    monkeypatch.setattr(saver_module._dist, "initialized", lambda: True)  # a rank of a one-rank job
    monkeypatch.setattr(saver_module._dist, "rank", lambda group=None: 0)
    monkeypatch.setattr(saver_module._dist, "world_size", lambda group=None: 1)
    monkeypatch.setattr(saver_module._dist, "agree", lambda problem, group=None: problem)
    save(SaveTarget(tmp_path, toy.components()), TrainState(0, 2, 2))
    assert modes == [True, False]  # alone: no collective; in a job: DCP's collective plan and metadata


def test_keep_last_keeps_the_newest_complete_checkpoints_and_finalize_defaults_to_permanent(tmp_path):
    parts = toy.components()
    for step in (1, 2, 3):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step), SaveOptions(keep_last=2))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_3"]
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4))
    (path / MARKER).unlink()
    assert finalize(tmp_path, path, TrainState(0, 4, 4), keep_last=0) is None
    assert json.loads((path / MARKER).read_text())["temporary"] is False


def test_retention_never_removes_the_checkpoint_just_saved(tmp_path):
    """A run resumed from an earlier checkpoint saves below checkpoints of a later attempt: keep_last
    counts those, but the one just saved (which `latest` names) stays."""
    parts = toy.components()
    for step in (4, 6):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step))
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2), SaveOptions(keep_last=1))
    assert is_complete(path) and (tmp_path / LATEST).read_text() == "step_2\n"
    assert "step_2" in [p.name for p in list_checkpoints(tmp_path)]


def test_a_model_without_parameters_saves_the_cpu_rng(tmp_path):
    model = torch.nn.Module()
    model.register_buffer("counts", torch.zeros(3))  # state, but nothing to tell the device by
    parts = Components(model, None, ())
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    assert set(json.loads((path / "rank_0.json").read_text())["rng"]) == {"python", "numpy", "torch_cpu"}


def test_the_rng_is_read_from_the_device_the_target_names(tmp_path, monkeypatch):
    """The model's parameters sit on the CPU, the run's device is another: its generator is saved."""
    read = []
    monkeypatch.setattr(saver_module, "rng_state", lambda device: read.append(device) or {})
    save(SaveTarget(tmp_path, toy.components(), device="meta"), TrainState(0, 1, 1))
    assert read == [torch.device("meta")]


def test_a_grad_scalers_state_is_saved_and_restored(tmp_path):
    parts = dataclasses.replace(toy.components(), grad_scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1))
    fresh = dataclasses.replace(toy.components(), grad_scaler=torch.amp.GradScaler("cpu"))
    restore(path, fresh)
    assert fresh.grad_scaler.state_dict() == parts.grad_scaler.state_dict()
    assert fresh.grad_scaler.state_dict()["scale"] == 1024.0


def test_a_ddp_wrapped_model_names_its_tied_weights_as_the_bare_model(monkeypatch):
    model = toy.Toy()
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model  # a DDP wrapper's shape, without a process group
    assert saver_module._tied_names(wrapped) == [["embed.weight", "head.weight"]] == saver_module._tied_names(model)


def test_make_room_never_removes_the_checkpoint_latest_names_and_lists_each_it_removes(
    tmp_path, monkeypatch, caplog
):
    parts = toy.components()
    one = bytes_under(save(SaveTarget(tmp_path, parts), TrainState(0, 1, 1)))
    for step in (2, 3):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step), SaveOptions(keep_last=5))
    (tmp_path / LATEST).write_text("step_1\n")  # e.g. a run resumed from step_1 by path
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 3.5))  # room for step_4 once one checkpoint goes
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4), SaveOptions(keep_last=2, make_room=True))
    assert saver_logs(caplog)[0] == "checkpoint.make_room: removed step_2 to make room for step_4"
    monkeypatch.undo()
    for step in (5, 6):
        save(SaveTarget(tmp_path, parts), TrainState(0, step, step), SaveOptions(keep_last=5))
    caplog.clear()
    fake_disk_capacity(monkeypatch, tmp_path, int(one * 4.5))  # four checkpoints: two must go
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 7, 7), SaveOptions(keep_last=3, make_room=True))
    assert saver_logs(caplog)[0] == "checkpoint.make_room: removed step_3, step_4 to make room for step_7"


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_a_failed_json_write_names_the_rank_of_several_and_the_step(tmp_path, monkeypatch, rank, world):
    monkeypatch.setattr(saver_module._dist, "rank", lambda group=None: rank)
    monkeypatch.setattr(saver_module._dist, "world_size", lambda group=None: world)
    step_dir(tmp_path, 3).mkdir(parents=True)  # rank 0 made it; on another rank prepare does not

    def full(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(saver_module, "write_json_atomic", full)
    with pytest.raises(CheckpointSaveError) as raised:
        save(SaveTarget(tmp_path, toy.components()), TrainState(0, 3, 3))
    who = f"rank {rank}: " if world > 1 else ""
    assert raised.value.line.startswith(
        f"checkpoint step_3 not saved: {who}ENOSPC No space left on device: {step_dir(tmp_path, 3) / f'rank_{rank}.json'}"
    )
    assert raised.value.step == 3


def test_a_step_directory_that_cannot_be_made_is_one_save_error_with_its_step(tmp_path):
    (tmp_path / "ckpt").write_text("a file where the checkpoint root should be")
    with pytest.raises(CheckpointSaveError) as raised:
        save(SaveTarget(tmp_path / "ckpt", toy.components()), TrainState(0, 5, 5))
    assert raised.value.step == 5
    assert raised.value.line.startswith(  # the directory it could not make, not a file it then tried to write
        f"checkpoint step_5 not saved: ENOTDIR Not a directory: {tmp_path / 'ckpt' / 'step_5'} (needs ~"
    )
