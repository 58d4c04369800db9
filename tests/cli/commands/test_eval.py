"""`fntrain eval`'s bad input that needs no lm-eval import: exit status 2, one line naming the flag or
the file as typed, nothing written. (The evaluation itself, a damaged checkpoint and the checks that
need lm-eval's task index are in tests/cli/commands/test_eval_harness.py, slow tier.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from fntrain.models.harness import results_table, task_names
from tests.helpers.commands import eval_refusal


def _hf_dir_without_tokenizer(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "gpt2"}')
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["{tmp}/nowhere", "--tasks", "x"], "SOURCE '{tmp}/nowhere' does not exist"),
        (["{hf}", "--tasks", "x", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["{hf}", "--tasks", "x", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["{hf}", "--tasks", "x", "--num-fewshot", "-1"], "--num-fewshot must be >= 0, got -1"),
        (["{hf}", "--tasks", " , "], "--tasks must name at least one task, got ' , '"),
        (["{hf}", "--tasks", "x", "--include-path", "{tmp}/no_tasks"], "--include-path '{tmp}/no_tasks' is not a directory"),
        (["{hf}", "--tasks", "x"], "SOURCE '{hf}' holds no tokenizer"),
        (["{tmp}/file.txt", "--tasks", "x"], "SOURCE '{tmp}/file.txt' is not a directory"),
    ],
)
def test_a_bad_eval_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    hf = _hf_dir_without_tokenizer(tmp_path / "hf")
    (tmp_path / "file.txt").write_text("not a model")
    before = sorted(p.name for p in tmp_path.iterdir())
    fill = {"{tmp}": str(tmp_path), "{hf}": str(hf)}
    args = [arg.replace("{tmp}", fill["{tmp}"]).replace("{hf}", fill["{hf}"]) for arg in args]
    err = eval_refusal(args, capsys)
    assert needle.replace("{tmp}", fill["{tmp}"]).replace("{hf}", fill["{hf}"]) in err
    assert err.startswith("fntrain eval: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no eval_results/, nothing else


def test_without_lm_eval_the_line_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # importlib.util.find_spec then answers None
    err = eval_refusal([str(tmp_path), "--tasks", "x"], capsys)
    assert err == "fntrain eval: fntrain eval needs lm-eval: pip install 'fntrain[eval]'"
    assert list(tmp_path.iterdir()) == []


def test_the_table_has_a_row_per_metric_and_the_task_list_is_parsed():
    results = {"results": {"tiny_mc": {"name": "tiny_mc", "alias": "tiny_mc", "sample_len": 8,
                                       "acc,none": 0.625, "acc_stderr,none": 0.18, "f1,strict": 0.5}}}  # fmt: skip
    lines = results_table(results).splitlines()
    assert lines[0].split() == ["task", "metric", "value", "stderr"]
    assert [line.split() for line in lines[1:]] == [["tiny_mc", "acc", "0.6250", "0.1800"],
                                                    ["tiny_mc", "f1", "(strict)", "0.5000", "-"]]  # fmt: skip
    assert task_names(" a, b ,,a") == ["a", "b"]


def test_recipe_names_the_recipe_that_rebuilds_a_checkpoint_as_for_generate(tmp_path, capsys, monkeypatch):
    from fntrain.cli.commands import eval as eval_command
    from fntrain.models.harness import EvalOptions

    monkeypatch.chdir(tmp_path)
    dispatch(["run", "tiny_gpt", "--run-dir", "run", "--model.n-layer", "1", "--model.n-head", "2",
              "--model.d-model", "16", "--model.context", "32", "--train.train-iters", "1",
              "--train.global-batch-size", "2", "--train.micro-batch-size", "2", "--checkpoint.save-every", "1",
              "--evaluate.no-at-end", "--progress.no-enabled", "--sample.no-at-end"])  # fmt: skip
    capsys.readouterr()
    source = eval_command._resolve("run")
    export = eval_command._export_plan("run", source, EvalOptions(tasks="x", recipe="tiny_gpt"))
    assert export.convert is not None and export.tokenizer is not None  # a GPT-2 with its byte tokenizer
    err = eval_refusal(["run", "--tasks", "x", "--recipe", "nope"], capsys)  # before lm-eval's task index
    assert "--recipe 'nope'" in err
    assert not (tmp_path / "run" / "eval").exists()
