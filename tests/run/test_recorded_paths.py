"""What a run records travels with it (fntrain/run/resolved.py): the files its config names are recorded
by absolute path in config.json and every checkpoint's meta.json, so `fntrain generate`, `export` and
`eval` read a run made with relative paths from any directory; a rerun naming the same file another way
is no settings change, a different file still is; the config keeps the user's spelling for messages."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from fntrain.cli import dispatch
from fntrain.run.resolved import path_fields, recorded_config, same_file
from recipes import hf_causal_lm, tiny_gpt

SMALL = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.d-model", "16", "--model.context", "32",
    "--train.train-iters", "2", "--train.global-batch-size", "4", "--train.micro-batch-size", "4",
    "--checkpoint.save-every", "2", "--evaluate.no-at-end", "--progress.no-enabled",
]  # fmt: skip


def test_the_files_a_config_names_are_recorded_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text("")
    base = hf_causal_lm.Config()
    config = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, path="model"),
        data=dataclasses.replace(base.data, path="./train.jsonl", val_path="gone.jsonl"),
        assets=dataclasses.replace(base.assets, chat_template="{{ messages }}"),
        output_dir="out",  # under run_dir, not the working directory: not a path field
    )
    assert {"model.path", "data.path", "data.val_path", "data.shards", "assets.tokenizer_path",
            "assets.chat_template", "checkpoint.dir"} <= set(path_fields(config))  # fmt: skip
    assert "output_dir" not in path_fields(config) and path_fields(tiny_gpt.Config()) == [
        "checkpoint.dir", "data.path", "data.shards"]  # fmt: skip
    recorded = recorded_config(config)
    assert recorded["model"]["path"] == str(tmp_path / "model")
    assert recorded["data"]["path"] == str(tmp_path / "train.jsonl")
    # a value that names nothing here is kept as written: a file not there (yet), a template's text
    assert (recorded["data"]["val_path"], recorded["assets"]["chat_template"]) == ("gone.jsonl", "{{ messages }}")
    assert (recorded["output_dir"], recorded["data"]["shards"]) == ("out", None)
    assert config.model.path == "model"  # the config itself keeps the user's spelling
    assert same_file("model", str(tmp_path / "model")) and same_file("./model/", "model")
    assert not same_file("model", "train.jsonl") and not same_file(None, "model") and not same_file("a", "b")


def test_a_run_made_with_relative_paths_reads_back_from_any_directory(tmp_path, monkeypatch, capsys):
    from fntrain.cli.commands import eval as eval_command
    from fntrain.models.harness import EvalOptions

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    Path("corpus.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    dispatch(["tokenize", "corpus.txt", "--output", "shards"])
    command = ["run", "tiny_gpt", "--run-dir", "runs/x", *SMALL]
    dispatch([*command, "--data.shards", "shards"])
    run = work / "runs" / "x"
    meta = json.loads((run / "checkpoints" / "step_2" / "meta.json").read_text())
    for recorded in (json.loads((run / "config.json").read_text()), meta["config"]):
        assert recorded["data"]["shards"] == str(work / "shards")
    greedy = ("--prompt", "To be", "--temperature", "0", "--max-new-tokens", "8")
    (here,) = dispatch(["generate", "runs/x", *greedy])

    # the same shards named another way: no settings change (the run is complete, nothing refused)
    for spelling in (str(work / "shards"), "./shards/"):
        dispatch([*command, "--data.shards", spelling])
    # other shards are another file: refused, named as the user typed them
    Path("other.txt").write_text("Something else entirely.\n" * 40)
    dispatch(["tokenize", "other.txt", "--output", "other_shards"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        dispatch([*command, "--data.shards", "other_shards"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and f"'{work / 'shards'}' -> 'other_shards'" in err, err

    monkeypatch.chdir(elsewhere)
    (there,) = dispatch(["generate", str(run), *greedy])  # the shards' EOS is found from here
    assert there.token_ids == here.token_ids
    dispatch(["export", str(run / "checkpoints"), "--format", "hf", "exported"])
    tokenizer_config = json.loads(Path("exported", "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|endoftext|>"  # the shards' EOS, read from here
    source = eval_command._resolve(str(run))
    export = eval_command._export_plan(str(run), source, EvalOptions(tasks="x"))
    assert export.convert is not None and export.tokenizer is not None  # not "records no tokenizer"
    assert os.listdir(elsewhere) == ["exported"]  # nothing written where the commands ran but the export


@pytest.mark.slow
def test_an_hf_run_made_with_relative_paths_exports_and_evaluates_from_another_directory(tmp_path, monkeypatch,
                                                                                           capsys):  # fmt: skip
    pytest.importorskip("transformers")
    from fntrain.cli.commands import eval as eval_command
    from fntrain.models.harness import EvalOptions
    from tests.helpers.hf import save_tiny_llama

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    lines = ["the cat sat on the mat", "a dog runs fast", "one plus one is two", "birds fly high"] * 4
    save_tiny_llama(work / "llama", lines, vocab_size=300, max_positions=64)
    Path("train.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    dispatch(["run", "hf_causal_lm", "--run-dir", "run", "--model.path", "llama", "--data.path", "train.jsonl",
              "--data.max-length", "16", "--train.train-iters", "2", "--train.global-batch-size", "2",
              "--train.micro-batch-size", "2", "--checkpoint.save-every", "2", "--progress.no-enabled"])  # fmt: skip
    greedy = ("--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "6")
    (here,) = dispatch(["generate", "run", *greedy])

    monkeypatch.chdir(elsewhere)
    run = work / "run"
    source = eval_command._resolve(str(run))
    eval_command._export_plan(str(run), source, EvalOptions(tasks="x"))  # was: "the run records no tokenizer"
    (there,) = dispatch(["generate", str(run / "checkpoints"), *greedy])  # the tokenizer of model.path
    assert there.token_ids == here.token_ids
    dispatch(["export", str(run / "checkpoints"), "--format", "hf", "exported"])
    assert {"config.json", "tokenizer.json"} <= set(os.listdir("exported"))  # model.path's files, from here
