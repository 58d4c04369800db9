"""`fntrain generate` on transformers models and on checkpoints written by several processes (slow tier):
an HF directory gives exactly the tokens transformers' own greedy `generate` gives; an hf_causal_lm run
(full and LoRA) samples from its checkpoint what its exported model samples; a 2-rank FSDP2 tiny GPT
checkpoint loads on one process and gives the greedy tokens of the gathered weights; the VLM takes an
image."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fntrain.cli import dispatch
from tests.helpers.waiting import run_to_end

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]
GREEDY = ("--temperature", "0", "--max-new-tokens", "10", "--device", "cpu")


@pytest.fixture(scope="module")
def hf_llama_files(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama with its tokenizer (save_pretrained layout) and a chat JSONL to fine-tune it on."""
    pytest.importorskip("transformers")
    from tests.helpers.hf import save_tiny_llama

    root = tmp_path_factory.mktemp("generate_hf")
    text = (ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_text()[:20_000]
    model_dir = save_tiny_llama(root / "model", text.splitlines(), vocab_size=320, max_positions=128)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    chats = [{"messages": [{"role": "user", "content": lines[2 * i]}, {"role": "assistant", "content": lines[2 * i + 1]}]}
             for i in range(8)]  # fmt: skip
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return model_dir, data


def test_an_hf_directory_gives_the_tokens_of_transformers_greedy_generate(hf_llama_files, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = hf_llama_files
    (sample,) = dispatch(["generate", str(model_dir), "--prompt", "ROMEO:", *GREEDY])
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    inputs = AutoTokenizer.from_pretrained(model_dir)("ROMEO:", return_tensors="pt")
    expected = model.generate(**inputs, do_sample=False, max_new_tokens=10)[0, inputs["input_ids"].shape[1] :]
    assert list(sample.token_ids) == expected.tolist()
    assert capsys.readouterr().out.startswith("ROMEO:")
    sampled = [
        dispatch(["generate", str(model_dir), "--seed", "3", "--max-new-tokens", "10"]) for _ in range(2)
    ]
    assert sampled[0][0].token_ids == sampled[1][0].token_ids  # the same seed, the same text


def _fine_tune(run: Path, llama: tuple[Path, Path], *extra: str) -> Path:
    model_dir, data = llama
    dispatch([
        "run", "hf_causal_lm", "--run-dir", str(run), "--model.path", str(model_dir), "--data.path", str(data),
        "--data.max-length", "48", "--train.train-iters", "2", "--train.global-batch-size", "2",
        "--train.micro-batch-size", "2", "--optim.lr", "1e-2", "--checkpoint.save-every", "2",
        "--progress.no-enabled", *extra,
    ])  # fmt: skip
    return run


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_hf_causal_lm_run_samples_its_checkpoint_as_its_export(hf_llama_files, tmp_path, lora, capsys):
    if lora:
        pytest.importorskip("peft")
    extra = ("--lora.rank", "4", "--lora.target-modules", "q_proj", "v_proj") if lora else ()
    run = _fine_tune(tmp_path / "run", hf_llama_files, *extra)
    (from_checkpoint,) = dispatch(["generate", str(run), "--prompt", "ROMEO:", *GREEDY])
    (from_export,) = dispatch(["generate", str(run / "hf_model"), "--prompt", "ROMEO:", *GREEDY])
    (base,) = dispatch(["generate", str(hf_llama_files[0]), "--prompt", "ROMEO:", *GREEDY])
    assert from_checkpoint.token_ids == from_export.token_ids
    assert from_checkpoint.token_ids != base.token_ids  # the fine-tuned weights (and adapter) are used


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_hf_run_logs_at_a_step_the_sample_generate_prints_from_that_steps_checkpoint(hf_llama_files, tmp_path,
                                                                                       lora, capsys):  # fmt: skip
    """`--sample.*` on an hf_causal_lm run (the recipes built on it share its sampler): the text
    samples.jsonl holds for step 2 is what `fntrain generate` prints from step 2's checkpoint with the same
    seed and settings, drawn (temperature 0.8), not greedy."""
    if lora:
        pytest.importorskip("peft")
    extra = ("--lora.rank", "4", "--lora.target-modules", "q_proj", "v_proj") if lora else ()
    sample = ("--sample.prompts", "ROMEO:", "JULIET:", "--sample.max-new-tokens", "12", "--sample.seed", "5")
    run = _fine_tune(tmp_path / "run", hf_llama_files, *extra, *sample, "--sample.every", "1")
    logged = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(row["step"], row["prompt"]) for row in logged] == [(1, "ROMEO:"), (1, "JULIET:"), (2, "ROMEO:"),
                                                                (2, "JULIET:")]  # fmt: skip
    for row in logged[2:]:
        (printed,) = dispatch(["generate", str(run / "checkpoints" / "step_2"), "--prompt", row["prompt"],
                               "--max-new-tokens", "12", "--seed", "5", "--device", "cpu"])  # fmt: skip
        assert printed.text == row["text"] and printed.token_ids, (printed, row)
    assert logged[0]["text"] != logged[2]["text"] or logged[1]["text"] != logged[3]["text"]  # the weights moved
    capsys.readouterr()


def test_a_two_rank_fsdp2_checkpoint_loads_on_one_process(tmp_path, capsys):
    from safetensors.torch import load_file

    from fntrain.models.gpt import ModelConfig, TinyGPT
    from fntrain.sampling import SampleSettings, sample_tokens

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fntrain",
        "run", "tiny_gpt", "--run-dir", str(run), "--parallel.strategy", "fsdp2", "--runtime.device", "cpu",
        "--train.train-iters", "2", "--train.global-batch-size", "4", "--train.micro-batch-size", "2",
        "--model.n-layer", "2", "--model.d-model", "32", "--model.n-head", "2", "--model.context", "32",
        "--checkpoint.save-every", "2", "--evaluate.no-at-end", "--progress.no-enabled",
    ]  # fmt: skip
    result = run_to_end(command, "the 2-rank FSDP2 `fntrain run tiny_gpt` (torchrun)", 240, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    meta = json.loads((run / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["world_size"] == 2
    (sample,) = dispatch(["generate", str(run / "checkpoints" / "step_2"), "--prompt", "ROMEO:", *GREEDY])
    model = TinyGPT(ModelConfig(n_layer=2, d_model=32, n_head=2, context=32))
    model.load_state_dict(load_file(run / "model.safetensors"))  # the weights gathered at the end
    settings = SampleSettings(max_new_tokens=10, temperature=0)
    expected = list(sample_tokens(model.eval(), torch.tensor(list(b"ROMEO:")), settings))
    assert list(sample.token_ids) == expected
    (as_gpt2,) = dispatch(["generate", str(run / "hf_model"), "--prompt", "ROMEO:", *GREEDY])
    assert list(as_gpt2.token_ids) == expected  # the GPT-2 export, sampled by transformers


def test_the_vlm_answers_about_an_image(tmp_path, capsys):
    pytest.importorskip("PIL")
    from PIL import Image

    from tests.helpers.vlm import tiny_model_dir

    model_dir = tiny_model_dir(str(tmp_path / "cache"))
    Image.new("RGB", (16, 16), (255, 0, 0)).save(tmp_path / "red.png")
    (sample,) = dispatch(["generate", str(model_dir), "--image", str(tmp_path / "red.png"),
                          "--prompt", "What colour is the shape?", *GREEDY])  # fmt: skip
    assert 1 <= len(sample.token_ids) <= 10
    shutil.rmtree(tmp_path / "cache")
