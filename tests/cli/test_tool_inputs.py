"""Bad input to the standalone commands (`fntrain plot`, `tokenize`, `export`, `eval`, and `--config` files),
as a user types it: exit status 2, one line on stderr naming the file as typed and what is wrong, no
traceback, and the disk left as it was (nothing created, an existing output untouched), so the
corrected command just works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fntrain.cli import dispatch
from tests.helpers.commands import expect_one_line
from tests.helpers.files import tree_hashes, write_file


@pytest.fixture
def bad_files(tmp_path, monkeypatch) -> Path:
    """The files the cases name, under tmp_path/in, and tmp_path as the working directory (so every
    path is typed relative, as a user types it)."""
    monkeypatch.chdir(tmp_path)
    good = "".join(json.dumps({"text": f"document {n}"}) + "\n" for n in range(4))
    write_file(tmp_path / "in" / "good.jsonl", good)
    write_file(tmp_path / "in" / "bad.jsonl", good[:30] + "\n{not json\n" + good)
    write_file(tmp_path / "in" / "binary.txt", bytes(range(256)) * 4)
    write_file(tmp_path / "in" / "a-file", "not a directory")
    write_file(
        tmp_path / "in" / "run" / "metrics.jsonl",
        '{"step": 1, "loss": 3.0}\nnot json\n{"step": 2, "loss": 2.0}\n',
    )
    write_file(tmp_path / "in" / "quiet" / "metrics.jsonl", '{"step": 1, "grad_norm": 1.0}\n')
    write_file(tmp_path / "in" / "bad.yaml", "train:\n  train_iters: [3\n  seed: 1\n")
    write_file(tmp_path / "in" / "binary.toml", bytes(range(256)) * 4)
    (tmp_path / "in" / "config-dir.toml").mkdir()
    weights = tmp_path / "in" / "hf"
    weights.mkdir()
    from safetensors.torch import save_file

    save_file({"linear.weight": torch.ones(2, 2)}, str(weights / "model.safetensors"))
    return tmp_path


PLOT_CASES = [
    ("run-missing", ["plot", "nowhere"], "run directory 'nowhere' does not exist"),
    ("run-is-a-file", ["plot", "in/a-file"], "'in/a-file' is a file, not a run directory"),
    ("no-metrics", ["plot", "in/hf"], "no metrics.jsonl in 'in/hf'"),
    ("malformed-metrics", ["plot", "in/run"], "'in/run/metrics.jsonl' line 2: not a JSON object"),
    ("nothing-to-plot", ["plot", "in/quiet", "--out-dir", "plots"], "nothing to plot: 'in/quiet'"),
]  # fmt: skip

TOKENIZE_CASES = [
    ("bad-json-line", ["tokenize", "in/good.jsonl", "in/bad.jsonl", "--output", "shards"], "'in/bad.jsonl' line 2: not JSON"),
    ("binary-input", ["tokenize", "in/binary.txt", "--output", "shards"], "'in/binary.txt' is not UTF-8 text"),
    ("input-missing", ["tokenize", "in/nope.jsonl", "--output", "shards"], "'in/nope.jsonl' does not exist"),
    ("output-is-a-file", ["tokenize", "in/good.jsonl", "--output", "in/a-file"], "'in/a-file' exists and is not a directory"),
    ("output-under-a-file", ["tokenize", "in/good.jsonl", "--output", "in/a-file/shards"],
     "'in/a-file/shards' cannot be created: 'in/a-file' is a file"),
]  # fmt: skip

EXPORT_CASES = [
    ("checkpoint-missing", ["export", "nowhere", "--format", "hf", "out"], "checkpoint 'nowhere' does not exist"),
    ("checkpoint-is-a-file", ["export", "in/a-file", "--format", "hf", "out"], "checkpoint 'in/a-file' is a file"),
    ("checkpoint-is-a-run-dir", ["export", "in/run-dir", "--format", "hf", "out"], "'in/run-dir' is a run directory"),
    ("out-is-a-file", ["export", "in/ckpt", "--format", "hf", "in/a-file"], "'in/a-file' exists and is not a directory"),
    ("out-under-a-file", ["export", "in/ckpt", "--format", "hf", "in/a-file/out"],
     "'in/a-file/out' cannot be created: 'in/a-file' is a file"),
    ("out-not-empty", ["export", "in/ckpt", "--format", "hf", "in/run"], "'in/run' is not empty (pass --overwrite"),
    ("hf-dir-missing", ["export", "nowhere", "--format", "dcp", "out"], "Hugging Face directory 'nowhere' does not exist"),
    ("hf-dir-is-a-checkpoint", ["export", "in/ckpt/step_0", "--format", "dcp", "out"], "is an fntrain checkpoint"),
    ("dcp-out-is-a-file", ["export", "in/hf", "--format", "dcp", "in/a-file"], "'in/a-file' exists and is not a directory"),
]  # fmt: skip

CONFIG_CASES = [
    ("yaml-syntax", ["config", "tiny_gpt", "--config", "in/bad.yaml"],
     "--config 'in/bad.yaml' line 3: while parsing a flow sequence from line 2"),
    ("binary-config", ["config", "tiny_gpt", "--config", "in/binary.toml"], "--config 'in/binary.toml' is not UTF-8 text"),
    ("config-is-a-directory", ["config", "tiny_gpt", "--config", "in/config-dir.toml"],
     "--config 'in/config-dir.toml' is a directory"),
    ("config-missing", ["plan", "tiny_gpt", "--config", "in/nope.toml"], "--config 'in/nope.toml' does not exist"),
]  # fmt: skip

EVAL_CASES = [  # tyro's 5-13-line usage boxes before [issue 48]: one line, as every command's
    ("eval-nothing", ["eval"], "missing required options SOURCE, --tasks"),
    ("eval-no-tasks", ["eval", "in/hf"], "missing required option --tasks"),
    ("eval-tasks-without-value", ["eval", "in/hf", "--tasks"], "--tasks needs a value"),
    ("eval-limit-not-a-number", ["eval", "in/hf", "--tasks", "x", "--limit", "many"],
     "--limit expects an integer (or None), got 'many'"),
    ("eval-unknown-flag", ["eval", "in/hf", "--tasks", "x", "--task-list", "y"], "unknown flag --task-list"),
]  # fmt: skip

CASES = PLOT_CASES + TOKENIZE_CASES + EXPORT_CASES + CONFIG_CASES + EVAL_CASES


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_leaves_the_disk_as_it_was(bad_files, capsys, argv, needle):
    if "yaml" in needle:
        pytest.importorskip("yaml")
    if argv[0] == "export":
        _checkpoint_and_run_dir(bad_files)
    capsys.readouterr()  # what setting up printed (the import's log lines) is not the command's
    before = tree_hashes(bad_files)
    expect_one_line(capsys, argv, needle)
    assert tree_hashes(bad_files) == before


def _checkpoint_and_run_dir(root: Path) -> None:
    """in/ckpt: an fntrain checkpoint root (imported from in/hf, so no run is needed); in/run-dir: a
    directory that looks like a run (it has checkpoints/)."""
    dispatch(["export", "in/hf", "--format", "dcp", "in/ckpt", "--step", "0"])
    (root / "in" / "run-dir" / "checkpoints").mkdir(parents=True)


def test_a_failed_tokenize_needs_no_overwrite_to_run_again(bad_files, capsys):
    """The bug a user hit: a bad JSONL left documents.bin behind, and the next attempt needed --overwrite."""
    expect_one_line(capsys, ["tokenize", "in/bad.jsonl", "--output", "shards"], "line 2: not JSON")
    assert not (bad_files / "shards").exists()
    index = dispatch(["tokenize", "in/good.jsonl", "--output", "shards"])
    assert index.documents == 4 and sorted(p.name for p in bad_files.iterdir()) == ["in", "shards"]


def test_a_failed_export_keeps_the_old_output_whole(bad_files, capsys):
    _checkpoint_and_run_dir(bad_files)
    assert dispatch(["export", "in/ckpt", "--format", "hf", "hf-out"]) == Path("hf-out")
    capsys.readouterr()
    before = tree_hashes(bad_files)
    expect_one_line(capsys, ["export", "in/ckpt", "--format", "hf", "hf-out"], "is not empty (pass --overwrite")
    expect_one_line(
        capsys, ["export", "nowhere", "--format", "hf", "hf-out", "--overwrite"], "does not exist"
    )
    assert tree_hashes(bad_files) == before
    assert dispatch(["export", "in/ckpt", "--format", "hf", "hf-out", "--overwrite"]) == Path("hf-out")  # the way out
