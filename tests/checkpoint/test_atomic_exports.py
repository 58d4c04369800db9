"""Exports are atomic: `<run_dir>/hf_model/` (tiny_gpt's `export_converted`, the HF recipes'
`save_hf_model`), `<run_dir>/model.safetensors` (`export_safetensors`) and `fntrain export`'s directory
(`export_hf`) are written beside their target and renamed into place, so a failure in the middle (a
full disk: a writer that fails after writing part of its file) leaves the previous export byte for
byte, or nothing, and no `.tmp-` leftover. A run whose export fails says what is kept and what is lost;
a failed checkpoint save names the step it was saving. Default tier: one process, tiny models."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fntrain.checkpoint import SaveTarget, export, save
from fntrain.checkpoint.hf_export import export_hf
from fntrain.checkpoint.staged_out import replaced_dir, unwritten
from fntrain.hooks import checkpoint_writes
from fntrain.run.config import CheckpointConfig
from fntrain.state import TrainState
from fntrain.step.components import Components
from tests.helpers.files import file_hashes

ROOT = Path(__file__).resolve().parents[2]


def export_leftovers(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def _half_then_full(real):
    """`real` save_file that writes half its file, then fails as a full disk does."""

    def failing(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as file:
            file.truncate(os.path.getsize(filename) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    return failing


@pytest.fixture
def full_disk(monkeypatch):
    """safetensors' `save_file` writes half its file, then fails as a full disk does."""
    monkeypatch.setattr(safetensors.torch, "save_file", _half_then_full(safetensors.torch.save_file))


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 3)


# ----------------------------------------------------------------------------- the writers


def test_a_replaced_directory_is_the_old_one_until_the_new_one_is_complete(tmp_path):
    out = tmp_path / "hf_model"
    with replaced_dir(out) as staging:
        (staging / "config.json").write_text("old")
        (staging / "model-00001-of-00002.safetensors").write_text("old shard")
    (out / "README.md").write_text("the user's notes")
    before = file_hashes(tmp_path)
    with pytest.raises(OSError, match="No space left") as caught, replaced_dir(out) as staging:
        (staging / "config.json").write_text("new")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert file_hashes(tmp_path) == before and export_leftovers(tmp_path) == []
    assert unwritten(caught.value).path == out and unwritten(caught.value).previous_kept
    with replaced_dir(out) as staging:
        (staging / "config.json").write_text("new")
        (staging / "model.safetensors").write_text("new weights")
    # the user's file is carried over; the old export's own files (its stale shard) are not
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == "new" and export_leftovers(tmp_path) == []


def test_an_output_dir_whose_parent_takes_no_new_entry_is_written_inside_it(tmp_path, monkeypatch):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("the user's notes")
    (out / "model-00001-of-00002.safetensors").write_text("old shard")
    real_mkdir = Path.mkdir

    def parent_read_only(self, *args, **kwargs):
        if self.parent == tmp_path and self != out:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", parent_read_only)
    with pytest.raises(OSError, match="No space left"), replaced_dir(out) as staging:
        (staging / "config.json").write_text("new")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model-00001-of-00002.safetensors"]
    with replaced_dir(out) as staging:
        assert staging.parent == out
        (staging / "config.json").write_text("new")
        (staging / "model.safetensors").write_text("new weights")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert export_leftovers(tmp_path) == []


def test_model_safetensors_keeps_the_previous_file_when_a_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    export.export_safetensors(Tiny(0), path)
    before = file_hashes(tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(safetensors.torch, "save_file", _half_then_full(safetensors.torch.save_file))
        with pytest.raises(OSError, match="No space left"):
            export.export_safetensors(Tiny(1), path)
    assert file_hashes(tmp_path) == before and export_leftovers(tmp_path) == []
    export.export_safetensors(Tiny(1), path)  # and a write that succeeds replaces it
    assert torch.equal(safetensors.torch.load_file(path)["lin.weight"], Tiny(1).lin.weight.detach())


def test_a_converted_export_fails_whole(tmp_path, full_disk):
    def convert(state):
        return {"model_type": "toy"}, {"w": state["lin.weight"]}

    with pytest.raises(OSError, match="No space left"):
        export.export_converted(Tiny(), tmp_path / "hf_model", convert)
    assert list(tmp_path.iterdir()) == []  # no hf_model with a config.json and no weights


class _FakeHF(torch.nn.Module):
    """What `save_hf_model` calls of a transformers model: `config.use_cache`, `save_pretrained` (the
    config first, then the weights: the weights' write fails)."""

    def __init__(self, fail: bool):
        super().__init__()
        self.config, self.fail = type("Config", (), {"use_cache": False})(), fail

    def save_pretrained(self, directory: str, state_dict=None) -> None:
        Path(directory, "config.json").write_text('{"new": true}')
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model.safetensors")
        Path(directory, "model.safetensors").write_text("weights")


def test_save_hf_model_leaves_the_previous_export_when_the_weights_fail(tmp_path):
    from fntrain.models.hf import ModelAssets, save_hf_model
    from fntrain.runtime.runtime import Runtime

    class Tokenizer:
        def save_pretrained(self, directory: str) -> None:
            Path(directory, "tokenizer.json").write_text("{}")

    assets = ModelAssets(Tokenizer(), 0, None, None)
    runtime = Runtime()
    out = tmp_path / "hf_model"
    save_hf_model(_FakeHF(fail=False), assets, out, runtime)
    before = file_hashes(tmp_path)
    with pytest.raises(OSError, match="No space left"):
        save_hf_model(_FakeHF(fail=True), assets, out, runtime)
    assert file_hashes(tmp_path) == before and export_leftovers(tmp_path) == []
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_fntrain_export_overwrite_keeps_the_old_output_when_it_fails(tmp_path, monkeypatch, capsys):
    from fntrain.cli import dispatch

    save(SaveTarget(tmp_path / "ckpt", Components(model=Tiny(), loss_fn=None, optimizers=())),
         TrainState(global_step=3))  # fmt: skip
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    before = file_hashes(tmp_path / "hf")
    monkeypatch.setattr(safetensors.torch, "save_file", _half_then_full(safetensors.torch.save_file))
    with pytest.raises(OSError, match="No space left"):
        export_hf(tmp_path / "ckpt", out, overwrite=True)
    assert file_hashes(tmp_path / "hf") == before and export_leftovers(tmp_path) == []
    with pytest.raises(SystemExit):
        dispatch(["export", str(tmp_path / "ckpt"), "--format", "hf", str(out), "--overwrite", "--recipe", "none"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fntrain export: [Errno 28] No space left on device while writing {str(out)!r}; the previous "
        f"{str(out)!r} is kept"
    )
    assert file_hashes(tmp_path / "hf") == before and export_leftovers(tmp_path) == []
    with pytest.raises(SystemExit):
        dispatch(["export", str(tmp_path / "ckpt"), "--format", "hf", str(tmp_path / "new" / "hf"), "--recipe", "none"])
    assert capsys.readouterr().err.strip().endswith("; nothing was written")
    assert not (tmp_path / "new").exists() and export_leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- a run's line


def tiny_export_config(tmp_path: Path, **checkpoint):
    from fntrain.hooks.evaluate import EvaluateConfig
    from fntrain.hooks.progress import ProgressConfig
    from recipes import tiny_gpt

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes((ROOT / "fntrain/data/corpora/shakespeare.txt").read_bytes()[:3000])
    base = tiny_gpt.Config()
    return tiny_gpt.spec, dataclasses.replace(
        base, run_dir=str(tmp_path / "run"), log_every=0,
        model=dataclasses.replace(base.model, context=32, n_layer=1, n_head=2, d_model=32),
        data=dataclasses.replace(base.data, path=str(corpus)),
        train=dataclasses.replace(base.train, train_iters=6, global_batch_size=8, micro_batch_size=4),
        evaluate=EvaluateConfig(eval_every=0, at_end=False), progress=ProgressConfig(enabled=False),
        checkpoint=CheckpointConfig(**checkpoint),
    )  # fmt: skip


def test_a_run_whose_export_fails_says_what_is_kept_and_what_is_lost(tmp_path, full_disk):
    from fntrain.run.job import RunAborted, run_job

    spec, config = tiny_export_config(tmp_path, save_every=3)
    with pytest.raises(RunAborted) as caught:
        run_job(config, spec)
    line = caught.value.line
    assert caught.value.exit_code == 1 and "\n" not in line
    assert line.startswith("run failed at step 6 exporting hf_model: OSError: No space left on device; "), line
    assert "; the checkpoints (newest step_6) are kept, the export was not written; full traceback in " in line
    run_dir = tmp_path / "run"
    assert not (run_dir / "hf_model").exists() and export_leftovers(run_dir) == []


def test_without_a_checkpoint_the_line_says_the_steps_are_lost(tmp_path, full_disk):
    from fntrain.run.job import RunAborted, run_job

    spec, config = tiny_export_config(tmp_path, save_every=0, save_at_end=False)
    with pytest.raises(RunAborted) as caught:
        run_job(config, spec)
    assert re.search(r"^run failed at step 6 exporting hf_model: OSError: .*; the export was not written; no "
                     r"checkpoint was saved, so the run's 6 steps are lost: set --checkpoint.save-every; full "
                     r"traceback in ", caught.value.line), caught.value.line  # fmt: skip


def test_a_failed_save_names_the_step_it_was_saving(tmp_path, monkeypatch):
    from fntrain.checkpoint import CheckpointSaveError
    from fntrain.run.job import RunAborted, run_job

    spec, config = tiny_export_config(tmp_path, save_every=2)
    real_save = checkpoint_writes.save

    def fails_at_4(target, state, *args, **kwargs):
        if state.global_step == 4:
            raise CheckpointSaveError("checkpoint step_4 not saved: ENOSPC No space left on device", 4)
        return real_save(target, state, *args, **kwargs)

    monkeypatch.setattr(checkpoint_writes, "save", fails_at_4)
    with pytest.raises(RunAborted) as caught:
        run_job(config, spec)
    assert caught.value.line.startswith("run failed at step 4: CheckpointSaveError: checkpoint step_4 not saved")
    metadata = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert metadata["failed_at"] == 4
