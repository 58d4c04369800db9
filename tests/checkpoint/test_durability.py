"""Checkpoint behaviours a user would lose silently (issue 30) [S36]: what is made durable before the
completion marker and `latest`, what retention may delete, what a manifest must list, and which rank
reads what. One process: a stand-in file system records fsync / replace / rename calls in order, and a
2-rank verification or restore runs with the rank faked (threads stand in for the ranks where they must
meet in a collective)."""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fntrain.checkpoint import (
    SaveOptions,
    SaveTarget,
    _dist,
    close_async_saves,
    find_latest,
    list_checkpoints,
    restore,
    save,
    save_async,
)
from fntrain.checkpoint.layout import DCP_METADATA, LATEST, MANIFEST, MARKER
from fntrain.checkpoint.rng import rng_state
from fntrain.checkpoint.verify import damage, verified, verify_collectively
from fntrain.hooks.base import stateful
from fntrain.state import TrainState
from tests.checkpoint import toy

PROC_FD = Path("/proc/self/fd")
needs_proc = pytest.mark.skipif(not PROC_FD.is_dir(), reason="names an fd through /proc/self/fd")


# ----------------------------------------------------------------------------- a recording file system


class FileOpRecorder:
    """os.fsync / os.replace / os.rename, recorded in call order as (kind, path[, target]) with
    resolved paths (an fsync is named by the file its descriptor points at), then done for real."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.events: list[tuple[str, ...]] = []
        self._lock = threading.Lock()
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: int) -> None:
            name = os.readlink(PROC_FD / str(fd))
            real_fsync(fd)
            self._add(("fsync", name))

        def replace(src, dst, **kwargs) -> None:
            real_replace(src, dst, **kwargs)
            self._add(("replace", _abs(src), _abs(dst)))

        def rename(src, dst, **kwargs) -> None:
            real_rename(src, dst, **kwargs)
            self._add(("rename", _abs(src), _abs(dst)))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "rename", rename)

    def _add(self, event: tuple[str, ...]) -> None:
        with self._lock:
            self.events.append(event)

    def index(self, kind: str, target: Path) -> int:
        """The position of the (last) `kind` event that put a file at `target`."""
        hits = [i for i, event in enumerate(self.events) if event[0] == kind and event[-1] == str(target)]
        assert hits, f"no {kind} onto {target} in {self.events}"
        return hits[-1]

    def fsynced(self, path: Path | str, before: int | None = None, after: int = -1) -> bool:
        """Whether `path` (a file or a directory) was fsynced after event `after` and before `before`."""
        end = len(self.events) if before is None else before
        return any(event == ("fsync", str(path)) for event in self.events[after + 1 : end])


def _abs(path) -> str:
    return str(Path(os.fspath(path)).resolve())


def _save(root: Path, step: int, asynchronous: bool, **kwargs) -> Path:
    parts = toy.components()
    state = TrainState(0, step, step)
    if not asynchronous:
        return save(SaveTarget(root, parts), state, SaveOptions(**kwargs))
    path = save_async(SaveTarget(root, parts), state, SaveOptions(**kwargs)).result(timeout=60)
    assert close_async_saves()
    return path


@needs_proc
@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "save_async"])
def test_data_files_are_fsynced_before_the_marker_and_latest(tmp_path, monkeypatch, asynchronous):
    """Every tensor file and DCP's metadata reach the disk before `COMPLETE` and `latest` are written:
    a power loss after the marker must never leave a complete-looking checkpoint with lost data."""
    root = tmp_path.resolve()
    record = FileOpRecorder(monkeypatch)
    path = _save(root, 3, asynchronous)
    marker = record.index("replace", path / MARKER)
    latest = record.index("replace", root / LATEST)
    data = sorted(path.glob("*.distcp"))
    assert data
    for file in data:
        assert record.fsynced(file, before=marker), f"{file.name} not fsynced before {MARKER}"
    metadata = record.index("rename", path / DCP_METADATA)
    staged = record.events[metadata][1]  # DCP writes its metadata to a temp file, then renames it
    assert record.fsynced(staged, before=metadata), "DCP metadata not fsynced before its rename"
    assert metadata < marker < latest


@needs_proc
@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "save_async"])
def test_json_files_marker_and_latest_are_fsynced_before_and_after_their_replace(
    tmp_path, monkeypatch, asynchronous
):
    """Each small file is written to a temp file, fsynced, renamed into place, and its directory fsynced,
    so a power loss leaves the old file or the whole new one, never an empty `COMPLETE` or `latest`; and
    the marker's directory entry is durable before `latest` names it."""
    root = tmp_path.resolve()
    record = FileOpRecorder(monkeypatch)
    path = _save(root, 3, asynchronous)
    for target in (path / "meta.json", path / "rank_0.json", path / MANIFEST, path / MARKER, root / LATEST):
        at = record.index("replace", target)
        temp = record.events[at][1]
        assert record.fsynced(temp, before=at), f"{target.name}: temp file not fsynced before os.replace"
        assert record.fsynced(target.parent, after=at), (
            f"{target.name}: directory not fsynced after os.replace"
        )
    marker, latest = record.index("replace", path / MARKER), record.index("replace", root / LATEST)
    assert record.fsynced(path, after=marker, before=latest), "marker not durable before latest names it"
    assert record.fsynced(root, after=latest)


# ----------------------------------------------------------------------------- retention


def test_keep_last_never_deletes_the_checkpoint_just_saved_behind_a_longer_attempt(tmp_path):
    """An earlier attempt went to step 8; this one resumed from an older step and saves step 4 with
    keep_last=2: the two newer checkpoints are the newest two, but step 4 (which `latest` names and the
    next restore needs) must stay."""
    for step in (6, 8):
        save(SaveTarget(tmp_path, toy.components()), TrainState(0, step, step))
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 4, 4), SaveOptions(keep_last=2))
    assert path.is_dir() and path in list_checkpoints(tmp_path)
    assert find_latest(tmp_path) == path
    restore("latest", toy.components(), root=tmp_path)  # still restorable


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("required", [DCP_METADATA, "meta.json"])
def test_a_manifest_that_omits_a_required_file_is_not_complete(tmp_path, required):
    """A manifest is a list of what must be there: one without DCP's metadata or meta.json (a manifest
    written before they were, or edited) does not verify, whatever the files on disk."""
    path = save(SaveTarget(tmp_path, toy.components()), TrainState(0, 2, 2))
    assert damage(path) is None and verified(path) is True
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"][required]
    (path / MANIFEST).write_text(json.dumps(manifest))
    found = damage(path)
    assert found is not None and found.file == required and "not in the manifest" in found.reason
    assert verified(path) is False


# ----------------------------------------------------------------------------- several ranks, faked


class FakeRanks:
    """`fntrain.checkpoint._dist` and `all_gather_object` for `world` ranks played by threads: each
    thread's rank is thread-local, and the gather meets at a barrier like the collective does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, world: int):
        self.world = world
        self.local = threading.local()
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world
        monkeypatch.setattr(_dist, "initialized", lambda: True)
        monkeypatch.setattr(_dist, "rank", lambda group=None: self.local.rank)
        monkeypatch.setattr(_dist, "world_size", lambda group=None: world)
        monkeypatch.setattr(torch.distributed, "all_gather_object", self.all_gather_object)

    def all_gather_object(self, output: list, obj, group=None) -> None:
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        output[:] = list(self.slots)
        self.barrier.wait()  # nobody writes the next gather's slot before all have read this one

    def run(self, function) -> list:
        """`function()` on every rank at once; the answers in rank order."""
        answers: list = [None] * self.world
        errors: list[BaseException] = []

        def play(rank: int) -> None:
            self.local.rank = rank
            try:
                answers[rank] = function()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=play, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if errors:
            raise errors[0]
        return answers


def _flip_a_byte(file: Path) -> None:
    blob = bytearray(file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    file.write_bytes(bytes(blob))


def test_a_two_rank_verification_checks_every_file(tmp_path, monkeypatch):
    """The ranks share the files to check: whichever rank's share holds the damaged file, both ranks
    find it and agree on the same answer (no file is left unchecked)."""
    source = save(SaveTarget(tmp_path / "source", toy.components()), TrainState(0, 2, 2))
    names = sorted(json.loads((source / MANIFEST).read_text())["files"])
    assert len(names) >= 4  # .metadata, the data, meta.json, rank_0.json: both shares are non-empty
    ranks = FakeRanks(monkeypatch, world=2)
    for name in names:
        path = tmp_path / name.strip(".") / "step_2"
        shutil.copytree(source, path)
        _flip_a_byte(path / name)
        answers = ranks.run(lambda path=path: verify_collectively(path))
        assert all(answer is not None and answer.file == name for answer in answers), (name, answers)
    intact = tmp_path / "intact" / "step_2"
    shutil.copytree(source, intact)
    assert ranks.run(lambda: verify_collectively(intact)) == [None, None]


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_each_rank_restores_its_own_rng_and_hook_states(tmp_path, monkeypatch):
    """Rank 1 restores rank_1.json, not rank 0's: its RNG stream (dropout masks, sampling) and its hooks'
    states (e.g. its data position) are its own after a resume."""
    parts = toy.components()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    counter = {"value": 0}
    hook = stateful(
        "counter", lambda event, state, info: None, lambda: dict(counter), lambda saved: counter.update(saved)
    )
    path = save(SaveTarget(tmp_path, parts, hooks=[hook]), TrainState(0, 2, 2))
    rank_0 = json.loads((path / "rank_0.json").read_text())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    rank_1_rng = rng_state()
    expected = _draws()  # what rank 1 draws right after its resume
    (path / "rank_1.json").write_text(
        json.dumps({**rank_0, "rank": 1, "rng": rank_1_rng, "hooks": {"counter": {"value": 11}}})
    )
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    monkeypatch.setattr(_dist, "rank", lambda group=None: 1)
    state = restore(path, toy.components(), hooks=[hook], verified=True)
    assert state == TrainState(0, 2, 2)
    assert _draws() == expected
    assert counter == {"value": 11}
