"""Checkpoints verified before they are trusted (issue 16, item 3) [S36]: every checkpoint has a manifest
of its files' sizes and CRC-32s; a damaged newest checkpoint is skipped with one warning naming the file
and the reason and the run resumes from the newest intact one; a damaged checkpoint named by path is a
one-line error; an incomplete one is moved aside, never deleted; `keep_last` counts and deletes only
what verifies; an export of a damaged checkpoint fails the same way and leaves nothing behind; a
checkpoint without a manifest (older fntrain) still restores; async saves leave no thread behind. The
2-rank gloo case (ranks agree on what to skip) is in the slow tier."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch

from fntrain.checkpoint import (
    CheckpointDamagedError,
    SaveOptions,
    SaveTarget,
    close_async_saves,
    list_checkpoints,
    make_stager,
    restore,
    save,
    save_async,
    step_dir,
)
from fntrain.checkpoint.layout import LATEST, MANIFEST, MARKER
from fntrain.checkpoint.verify import damage, read_manifest, verified
from fntrain.config import ConfigError
from fntrain.state import TrainState
from tests.checkpoint import toy
from tests.helpers.ports import free_port
from tests.helpers.workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DATA = "__0_0.distcp"


two_checkpoints = toy.two_checkpoints


def truncate(path: Path) -> str:
    with open(path / DATA, "r+b") as handle:
        handle.truncate(os.path.getsize(path / DATA) // 2)
    return "truncated"


def change(path: Path) -> str:
    blob = bytearray((path / DATA).read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # one flipped byte, same size
    (path / DATA).write_bytes(bytes(blob))
    return "changed: crc32"


def remove(path: Path) -> str:
    (path / DATA).unlink()
    return "missing"


DAMAGE = {"truncated": truncate, "changed": change, "missing": remove}


def warnings_from(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 1, 1))
    manifest = read_manifest(path)
    assert manifest["format"] == 1 and manifest["algorithm"] == "crc32"
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST, MARKER}
    assert set(manifest["files"]) == on_disk == {".metadata", DATA, "meta.json", "rank_0.json"}
    for name, entry in manifest["files"].items():
        blob = (path / name).read_bytes()
        assert entry == {"size": len(blob), "crc32": f"{zlib.crc32(blob):08x}"}
    assert damage(path) is None and verified(path) is True


@pytest.mark.parametrize("source", ["latest", "auto"])
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_is_skipped_with_one_warning_and_the_previous_restored(tmp_path, caplog, kind, source):
    at_2, _ = two_checkpoints(tmp_path)
    newest = step_dir(tmp_path, 4)
    reason = DAMAGE[kind](newest)
    fresh = toy.components(seed=7)
    with caplog.at_level(logging.INFO, logger="fntrain.checkpoint"):
        state = restore(source, fresh, root=tmp_path)
    assert state == TrainState(0, 2, 2)
    assert all(torch.equal(at_2[k], v) for k, v in toy.weights(fresh).items())  # exactly step 2's state
    (warning,) = warnings_from(caplog)  # one warning, naming the file and the reason
    assert f"step_4/{DATA}" in warning and reason in warning and "step_2" in warning
    # Moved aside, never deleted; the pointer names the checkpoint restored.
    aside = tmp_path / "step_4.damaged"
    assert not newest.exists() and aside.is_dir() and (kind == "missing" or (aside / DATA).is_file())
    assert (tmp_path / LATEST).read_text().strip() == "step_2"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore(source, toy.components(), root=tmp_path) == TrainState(0, 2, 2)
    assert warnings_from(caplog) == []  # said once


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_checkpoint_named_by_path_is_a_one_line_error(tmp_path, kind):
    two_checkpoints(tmp_path)
    newest = step_dir(tmp_path, 4)
    reason = DAMAGE[kind](newest)
    with pytest.raises(CheckpointDamagedError) as caught:
        restore(newest, toy.components(), root=tmp_path)
    message = str(caught.value)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)
    assert "\n" not in message and f"{newest / DATA}" in message and reason in message
    assert newest.is_dir()  # a checkpoint the user named is left where it is


def test_damaged_metadata_or_manifest_is_named_too(tmp_path):
    two_checkpoints(tmp_path)
    newest = step_dir(tmp_path, 4)
    (newest / ".metadata").write_bytes(b"\x80\x04junk")
    assert str(damage(newest)).endswith(".metadata: truncated: 6 bytes, the manifest says " + str(
        read_manifest(newest)["files"][".metadata"]["size"]))  # fmt: skip
    (newest / MANIFEST).write_text("{not json")
    problem = damage(newest)
    assert problem.file == MANIFEST and "unreadable" in problem.reason


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    two_checkpoints(tmp_path)
    truncate(step_dir(tmp_path, 2))
    truncate(step_dir(tmp_path, 4))
    with pytest.raises(CheckpointDamagedError, match="no intact checkpoint to restore"):
        restore("auto", toy.components(), root=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_2.damaged", "step_4.damaged"]


def test_an_incomplete_checkpoint_is_moved_aside_with_its_bytes(tmp_path):
    two_checkpoints(tmp_path)
    partial = step_dir(tmp_path, 4)
    (partial / MARKER).unlink()  # as if killed between .metadata and the marker
    blob = (partial / DATA).read_bytes()
    (tmp_path / "step_4.incomplete").mkdir()  # an earlier one: the name is taken
    assert restore("latest", toy.components(), root=tmp_path) == TrainState(0, 2, 2)
    assert not partial.exists()
    assert (tmp_path / "step_4.incomplete.1" / DATA).read_bytes() == blob


def test_saving_over_an_incomplete_step_moves_it_aside(tmp_path):
    parts = toy.components()
    path = save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    (path / MARKER).unlink()
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    assert damage(path) is None and (tmp_path / "step_2.incomplete" / DATA).is_file()


def test_keep_last_counts_and_deletes_only_verified_checkpoints(tmp_path, caplog):
    parts = toy.components()
    save(SaveTarget(tmp_path, parts), TrainState(0, 2, 2))
    save(SaveTarget(tmp_path, parts), TrainState(0, 4, 4))
    change(step_dir(tmp_path, 4))
    partial = step_dir(tmp_path, 6)
    partial.mkdir()
    (partial / DATA).write_bytes(b"half a save")  # maybe a save in flight: never touched by retention
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        save(SaveTarget(tmp_path, parts), TrainState(0, 8, 8), SaveOptions(keep_last=2))
    # step_4 does not count (damaged: moved aside with a warning), so step_2 is one of the two kept.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_8"]
    assert (tmp_path / "step_4.damaged" / DATA).is_file() and (partial / DATA).is_file()
    assert any("step_4" in message and "changed" in message for message in warnings_from(caplog))
    save(SaveTarget(tmp_path, parts), TrainState(0, 10, 10), SaveOptions(keep_last=2))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_8", "step_10"]  # verified: deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        LATEST, "step_10", "step_4.damaged", "step_6", "step_8",
    ]  # fmt: skip


def test_keep_last_neither_counts_nor_deletes_checkpoints_without_a_manifest(tmp_path):
    parts = toy.components()
    for step in (2, 4):
        (
            save(SaveTarget(tmp_path, parts), TrainState(0, step, step)) / MANIFEST
        ).unlink()  # an older fntrain's
    save(SaveTarget(tmp_path, parts), TrainState(0, 6, 6), SaveOptions(keep_last=1))
    save(SaveTarget(tmp_path, parts), TrainState(0, 8, 8), SaveOptions(keep_last=1))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_4", "step_8"]


def test_a_checkpoint_without_a_manifest_still_restores_with_one_warning(tmp_path, caplog):
    at_2, at_4 = two_checkpoints(tmp_path)
    for step in (2, 4):
        (step_dir(tmp_path, step) / MANIFEST).unlink()  # saved before manifests existed
    fresh = toy.components(seed=3)
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore("latest", fresh, root=tmp_path) == TrainState(0, 4, 4)
    assert all(torch.equal(at_4[k], v) for k, v in toy.weights(fresh).items())
    (warning,) = warnings_from(caplog)
    assert "no manifest" in warning and "step_4" in warning
    # What can be checked without checksums still is: a truncated data file is found from DCP's metadata.
    truncate(step_dir(tmp_path, 4))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fntrain.checkpoint"):
        assert restore("latest", fresh, root=tmp_path) == TrainState(0, 2, 2)
    assert any(f"step_4/{DATA}: truncated" in message for message in warnings_from(caplog))
    assert all(torch.equal(at_2[k], v) for k, v in toy.weights(fresh).items())


def test_export_of_a_damaged_checkpoint_fails_in_one_line_and_leaves_nothing(tmp_path, capsys):
    from fntrain.checkpoint.hf_export import export_hf
    from fntrain.cli import dispatch

    root = tmp_path / "ckpt"
    two_checkpoints(root)
    newest = step_dir(root, 4)
    truncate(newest)
    out = tmp_path / "exports" / "hf"
    with pytest.raises(CheckpointDamagedError, match=f"{DATA}: truncated"):
        export_hf(newest, out)
    assert not out.exists() and list(out.parent.iterdir()) == [] if out.parent.exists() else True
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["export", str(newest), "--format", "hf", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and any(f"{DATA}: truncated" in line for line in err)
    assert not out.exists()
    assert newest.is_dir()  # an export never moves or changes the checkpoint


def test_an_export_failing_midway_leaves_no_partial_output(tmp_path, monkeypatch):
    from fntrain.checkpoint import hf_export

    root = tmp_path / "ckpt"
    two_checkpoints(root)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "_write_config", broken)
    with pytest.raises(OSError, match="disk full"):
        hf_export.export_hf(root, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no output, no temporary directory


def test_async_saves_write_the_manifest_before_the_marker_and_leave_no_thread(tmp_path, monkeypatch):
    import fntrain.checkpoint.saver as saver

    order = []
    for name in ("write_manifest", "write_marker"):
        original = getattr(saver, name)

        def recording(path, *args, _original=original, _name=name, **kwargs):
            order.append((_name, threading.current_thread() is threading.main_thread()))
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(saver, name, recording)
    before = set(threading.enumerate())
    parts = toy.components()
    stager = make_stager()
    for step in (1, 2, 3):
        pending = save_async(
            SaveTarget(tmp_path, parts), TrainState(0, step, step), SaveOptions(keep_last=2), stager=stager
        )
        assert pending.result() == step_dir(tmp_path, step) and damage(pending.path) is None
    assert order[:2] == [("write_manifest", False), ("write_marker", False)]  # in DCP's thread, in order
    stager.close()
    assert set(threading.enumerate()) == before


def test_a_hook_run_with_async_saves_leaves_no_thread(tmp_path):
    from fntrain import StepInfo
    from fntrain.hooks.checkpoint import checkpoint_hook
    from fntrain.loop import Event
    from fntrain.run.config import CheckpointConfig
    from fntrain.runtime.runtime import Runtime

    for ending in (Event.TRAIN_END, Event.ABORT):
        before = set(threading.enumerate())
        config = CheckpointConfig(save_every=1, async_save=True, keep_last=2, preempt_signals=())
        hook = checkpoint_hook(config, SaveTarget(tmp_path / ending.name, toy.components()), Runtime())
        state = TrainState()
        hook(Event.TRAIN_BEGIN, state, None)
        for _ in range(3):
            hook(Event.STEP_BEGIN, state, None)
            state = state.after_step()
            hook(Event.STEP_END, state, StepInfo({}))
        hook(ending, state, None if ending is Event.TRAIN_END else RuntimeError("boom"))
        assert set(threading.enumerate()) == before, ending
    assert close_async_saves(timeout=0) is True


# ----------------------------------------------------------------------------- slow: two ranks


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_agree_to_skip_a_damaged_shard_of_rank_1(tmp_path):
    """Saved by 2 gloo ranks; rank 1's data file of the newest checkpoint is damaged: both ranks skip it
    (rank 0 alone warns), restore the same previous checkpoint with exactly its state, and both raise
    the same one-line error when it is named by path."""
    port = free_port()

    def env_of_rank(rank: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK",)}
        env.update(
            RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
        )  # fmt: skip
        return env

    def command_of_rank(rank: int) -> list[str]:
        return [sys.executable, "-m", "tests.checkpoint.verify_worker", str(tmp_path / "ckpt"), str(tmp_path / f"{rank}.json")]

    run_ranks(2, command_of_rank, env_of_rank, "the 2 verify workers", 150, tmp_path)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for rank, result in enumerate(results):
        assert result["damaged_file"] == "__1_0.distcp", result
        assert result["restored"] == {"epoch": 0, "global_step": 2, "cursor": 2}, (rank, result)
        assert result["weights_match_step_2"], rank
        assert "__1_0.distcp" in result["explicit_error"] and "\n" not in result["explicit_error"]
    assert results[0]["explicit_error"] == results[1]["explicit_error"]
    assert len(results[0]["warnings"]) == 1 and "__1_0.distcp" in results[0]["warnings"][0]
    assert results[1]["warnings"] == []
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [LATEST, "step_2", "step_4.damaged"]
