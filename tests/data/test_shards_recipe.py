"""`fntrain tokenize` output feeds the tiny GPT recipe (`--data.shards DIR`): the flag's rules, the
vocabulary the shards imply (bytes + EOS = 257), a 3-step run through the real CLI that exports a GPT-2
of that vocabulary, and a bitwise resume across shard boundaries."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fntrain.cli import dispatch
from fntrain.data.tokenize import TokenizeSettings, tokenize_files
from recipes import tiny_gpt

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model.context", "16", "--model.n-layer", "1", "--model.n-head", "2", "--model.d-model", "16",
         "--train.global-batch-size", "4", "--train.micro-batch-size", "2", "--progress.no-enabled",
         "--evaluate.no-at-end", "--throughput.no-enabled", "--log-every", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    """The first 6 KB of the bundled corpus as byte tokens, one document per paragraph, in 1000-token
    shards (so windows and resumes cross shard boundaries)."""
    root = tmp_path_factory.mktemp("shards")
    text = root / "corpus.txt"
    text.write_text((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_text()[:6000])
    index = tokenize_files([text], root / "shards", split="paragraph", settings=TokenizeSettings(shard_tokens=1000))
    assert index.vocab_size == 257 and index.eos_id == 256 and len(index.shards) > 3
    return root / "shards"


def test_flag_rules_name_the_flag(shards_dir, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello")
    for args, words in (
        (["--data.shards", str(shards_dir), "--data.path", str(corpus)], "--data.path and --data.shards exclude"),
        (["--data.shards", str(tmp_path)], "--data.shards"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            dispatch(["run", "tiny_gpt", "--run-dir", str(tmp_path / "run"), *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    config = tiny_gpt.Config(data=tiny_gpt.DataConfig(shards=str(shards_dir)))
    config.validate()
    assert tiny_gpt.model_config(config).vocab_size == 257  # the shards' vocabulary: bytes + EOS
    wider = dataclasses.replace(config, model=tiny_gpt.ModelConfig(vocab_size=320))
    assert tiny_gpt.model_config(wider).vocab_size == 320  # a larger table is kept
    assert tiny_gpt.model_config(tiny_gpt.Config()).vocab_size == 256
    train, val = tiny_gpt.build_datasets(config)
    assert (len(train), len(val)) == tiny_gpt.dataset_sizes(config) and len(val) > 0
    assert train[0]["input_ids"].shape == (128,) and int(train[0]["input_ids"].max()) < 257


def test_three_steps_on_shards_through_the_cli(shards_dir, tmp_path):
    run = tmp_path / "run"
    dispatch(["run", "tiny_gpt", "--run-dir", str(run), "--data.shards", str(shards_dir),
              "--train.train-iters", "3", *SMALL])  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert load_file(run / "model.safetensors")["tok.weight"].shape == (257, 16)
    hf_config = json.loads((run / "hf_model" / "config.json").read_text())
    assert (hf_config["vocab_size"], hf_config["eos_token_id"], hf_config["model_type"]) == (257, 256, "gpt2")


def test_resume_on_shards_is_bitwise(shards_dir, tmp_path):
    common = ["--data.shards", str(shards_dir), "--schedule.lr-schedule-iters", "4", "--checkpoint.save-every", "2",
              *SMALL]  # fmt: skip
    dispatch(
        ["run", "tiny_gpt", "--run-dir", str(tmp_path / "straight"), "--train.train-iters", "4", *common]
    )
    dispatch(["run", "tiny_gpt", "--run-dir", str(tmp_path / "resumed"), "--train.train-iters", "2", *common])
    dispatch(["run", "tiny_gpt", "--run-dir", str(tmp_path / "resumed"), "--train.train-iters", "4", *common,
              "--checkpoint.restore-from", "latest", "--checkpoint.allow-changes", "train.train_iters"])  # fmt: skip
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(straight[k].equal(resumed[k]) for k in straight)
    losses = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2, 3, 4]
