"""The Hugging Face causal-LM recipe: its settings and their one-line errors (fast), and (slow tier) a
real tiny Llama + BPE tokenizer built in the test, fine-tuned 3 steps on chat JSONL, reloaded with
transformers; its plan; a 2-rank FSDP2 fine-tune under torchrun. The data transform and the model
loading it uses are pinned in tests/data/test_sft.py and tests/models/test_hf.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fntrain.cli import dispatch
from fntrain.data.sft import SFTDataConfig, build_sft_datasets, transform_example
from fntrain.data.tokens import IGNORE_INDEX
from fntrain.hooks.evaluate import EvaluateConfig
from fntrain.hooks.progress import ProgressConfig
from fntrain.models.hf_config import AssetsConfig, HFModelConfig
from fntrain.models.lora import LoraConfig
from fntrain.run.config import CheckpointConfig, TrainConfig
from fntrain.run.job import run_job
from fntrain.step.optim import OptimizerConfig
from recipes import hf_causal_lm as hf
from tests.helpers.fork_server import HF_PRELOAD, started
from tests.helpers.hf import CHATS, TEMPLATE, save_tiny_llama
from tests.helpers.waiting import run_to_end

ROOT = Path(__file__).resolve().parents[2]


def test_config_validation_names_fields_and_checks_paths(tiny_files):
    model_dir, data_path = tiny_files
    with pytest.raises(ValueError, match="model.path is required"):
        hf.Config().validate()
    base = hf.Config(model=HFModelConfig(path=str(model_dir)), data=hf.DataConfig(path=str(data_path)))
    base.validate()
    with pytest.raises(ValueError, match="data.max_length must be >= 2"):
        dataclasses.replace(base, data=dataclasses.replace(base.data, max_length=1)).validate()
    with pytest.raises(TypeError, match="data.packing must be a bool"):
        dataclasses.replace(base, data=dataclasses.replace(base.data, packing=1)).validate()
    with pytest.raises(ValueError, match="data.path"):  # a ConfigError: one line, exit status 2
        dataclasses.replace(base, data=hf.DataConfig(path=str(data_path) + ".missing")).validate()
    with pytest.raises(ValueError, match="evaluate needs validation data"):
        dataclasses.replace(base, evaluate=EvaluateConfig(eval_every=5)).validate()
    assert base.output_path() == Path("runs/hf_causal_lm/hf_model")
    assert dataclasses.replace(base, output_dir="/abs/out").output_path() == Path("/abs/out")


def test_bad_settings_are_one_line_naming_the_flag(tiny_files, capsys):
    model_dir, data_path = tiny_files
    for args, words in (
        ([], "--model.path is required"),
        (["--model.path", "meta-llama/Llama-3-8B"], "--model.path 'meta-llama/Llama-3-8B' is not a local directory"),
        (["--model.path", str(model_dir), "--data.path", "nope.jsonl"], "--data.path 'nope.jsonl' does not exist"),
        (["--model.path", str(model_dir), "--data.path", str(data_path), "--data.packing",
          "--model.attn-implementation", "eager"], "--model.attn-implementation"),
        (["--model.path", str(model_dir), "--data.path", str(data_path), "--parallel.tp-size", "3"],
         "--parallel.tp-size (3) must divide the model's num_attention_heads (4)"),
        (["--model.path", str(model_dir), "--data.path", str(data_path), "--parallel.tp-size", "2",
          "--lora.rank", "4"], "--lora.rank > 0 cannot be combined with --parallel.tp-size=2"),
    ):  # fmt: skip
        (model_dir / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2}')
        with pytest.raises(SystemExit) as exit_info:
            dispatch(["run", "hf_causal_lm", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_shards_flags_are_checked_before_any_model_work(tiny_files, tmp_path, capsys):
    """[issue 27] continued pretraining's --data.shards: one line each, exit status 2, nothing created."""
    model_dir, data_path = tiny_files
    (tmp_path / "unfinished").mkdir()
    for args, words in (
        (["--data.shards", str(tmp_path / "nowhere")], f"--data.shards {str(tmp_path / 'nowhere')!r} does not exist"),
        (["--data.shards", str(tmp_path / "unfinished")], "holds no index.json"),
        (["--data.shards", str(tmp_path / "unfinished"), "--data.path", str(data_path)],
         "--data.path does not apply to --data.shards"),
        (["--data.shards", str(tmp_path / "unfinished"), "--data.packing"], "--data.packing does not apply"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            dispatch(["run", "recipes.hf_causal_lm", "--model.path", str(model_dir),  # this checkout's
                      "--run-dir", str(tmp_path / "run"), *args])  # fmt: skip
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.fixture
def tiny_files(tmp_path):
    """A model directory that passes the path checks (config.json + a safetensors file) and a JSONL."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"")
    data_path = tmp_path / "chat.jsonl"
    data_path.write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    return model_dir, data_path


# ----------------------------------------------------------------------------- slow: real transformers


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A tiny Llama and a BPE tokenizer trained on a slice of the bundled corpus, saved with
    save_pretrained; plus a chat JSONL file."""
    root = tmp_path_factory.mktemp("hf")
    text = (ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_text()[:60_000]
    model_dir = save_tiny_llama(root / "model", text.splitlines(), vocab_size=320, max_positions=128)

    lines = text.splitlines()
    chats = []
    for index in range(16):
        question, answer = lines[2 * index + 10].strip() or "Speak.", lines[2 * index + 11].strip() or "Aye."
        chats.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )
    data_path = root / "chat.jsonl"
    data_path.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    return model_dir, data_path


def hf_run_config(model_dir: Path, data_path: Path, run_dir: Path, **data) -> hf.Config:
    return hf.Config(
        run_dir=str(run_dir),
        log_every=1,
        model=HFModelConfig(path=str(model_dir)),
        data=hf.DataConfig(path=str(data_path), max_length=48, **data),
        train=TrainConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        optim=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        progress=ProgressConfig(enabled=False),
    )


@pytest.mark.slow
def test_fine_tune_three_steps_then_reload_with_transformers(tiny_hf_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, data_path = tiny_hf_model
    config = dataclasses.replace(
        hf_run_config(model_dir, data_path, tmp_path / "run", val_fraction=0.25),
        evaluate=EvaluateConfig(at_end=True),
        checkpoint=CheckpointConfig(save_every=2, export=False),
    )
    state = run_job(config, hf.spec).state
    assert state.global_step == 3

    out = tmp_path / "run" / "hf_model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer.chat_template == TEMPLATE
    for name, tensor in model.state_dict().items():
        if name in after:
            assert torch.equal(tensor, after[name]), name
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Who art thou?"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert (
        generated.shape[1] == inputs["input_ids"].shape[1] + 5 or generated[0, -1] == tokenizer.eos_token_id
    )

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3] and all(
        r.get("loss", 1) > 0 for r in records
    )
    assert any("val_loss" in r for r in records)
    from fntrain.cli.config_file import load_config

    assert load_config(hf.Config, tmp_path / "run" / "config.json") == config

    # The run checkpointed at step 2 and at its end; a longer run resumes from the latest one.
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    longer = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, train_iters=4),
        checkpoint=dataclasses.replace(
            config.checkpoint, restore_from="latest", allow_changes=("train.train_iters",)
        ),
    )
    assert run_job(longer, hf.spec).state.global_step == 4
    steps = [
        json.loads(line).get("step") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps.count(4) >= 1 and steps.count(1) == 1  # resumed at step 3, not from scratch


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same_and_saves_a_cache_enabled_config(tiny_hf_model, tmp_path):
    """Training runs the model without its KV cache (a recomputed forward would append to it again);
    the saved model keeps use_cache on for generation."""
    model_dir, data_path = tiny_hf_model
    losses = []
    for checkpointing in (False, True):
        config = hf_run_config(model_dir, data_path, tmp_path / str(checkpointing))
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, activation_checkpointing=checkpointing)
        )
        run_job(config, hf.spec)
        rows = (tmp_path / str(checkpointing) / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(row)["loss"] for row in rows if "loss" in json.loads(row)])
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    saved = json.loads((tmp_path / "True" / "hf_model" / "config.json").read_text())
    assert saved["use_cache"] is True


@pytest.mark.slow
def test_real_tokenizer_masks_prompt_tokens(tiny_hf_model):
    from transformers import AutoTokenizer

    model_dir, _ = tiny_hf_model
    config = hf.Config(model=HFModelConfig(path=str(model_dir)))
    assets = hf.build_assets(config)
    assert (
        isinstance(assets.tokenizer, type(AutoTokenizer.from_pretrained(model_dir)))
        and assets.tokenizer.is_fast
    )
    example = transform_example({"messages": CHATS[1]}, assets, SFTDataConfig())
    trained = assets.tokenizer.decode([label for label in example.labels if label != IGNORE_INDEX])
    assert trained == "Well met.</s>\nLa la.</s>\n"
    override = dataclasses.replace(config, assets=AssetsConfig(chat_template="{{ messages[0]['content'] }}"))
    assert hf.build_assets(override).chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.slow
def test_plan_for_two_ranks_reads_no_weights(tiny_hf_model, monkeypatch, capsys):
    from fntrain.cli import dispatch
    from fntrain.cli.recipes import load_recipe

    model_dir, data_path = tiny_hf_model
    module = load_recipe("hf_causal_lm").module  # fntrain_recipes.hf_causal_lm when installed
    monkeypatch.setattr(module, "load_causal_lm", lambda *a, **k: pytest.fail("plan must not load the model"))
    report = dispatch(
        ["plan", "hf_causal_lm", "--world-size", "2", "--parallel.strategy", "fsdp2", "--model.path", str(model_dir),
         "--data.path", str(data_path),

         "--data.packing", "--data.max-length", "32", "--train.global-batch-size", "4", "--train.micro-batch-size", "1"]
    )  # fmt: skip
    assets = hf.build_assets(hf_run_config(model_dir, data_path, Path("unused")))
    packed, _ = build_sft_datasets(SFTDataConfig(path=str(data_path), packing=True, max_length=32), assets)
    assert report["dataset_len"] == len(packed) and report["packing"] is True
    assert (report["dp_size"], report["micro_batches"]) == (2, 2)
    assert report["steps_per_epoch"] == (len(packed) // 2) // 2
    assert "world size          2 (data-parallel 2)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def hf_launch_env():
    """The environment of this module's `torchrun` and `fntrain` commands: each forks from one process
    that imported torch, transformers and peft once (tests/helpers/fork_server.py), its own process all the same."""
    with started({**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, HF_PRELOAD) as env:
        yield env


def _fsdp2_fine_tune(model_dir: Path, data_path: Path, tmp_path: Path, env: dict, *extra: str) -> Path:
    """`torchrun --nproc_per_node 2 -m fntrain run hf_causal_lm` for 2 FSDP2 steps; its output_dir."""
    command = [
        "torchrun", "--standalone", "--nproc_per_node", "2", "-m", "fntrain", "run", "hf_causal_lm",
        "--run-dir", str(tmp_path / "run"), "--model.path", str(model_dir), "--data.path", str(data_path),
        "--data.max-length", "48", "--train.train-iters", "2", "--train.global-batch-size", "4",
        "--train.micro-batch-size", "1", "--parallel.strategy", "fsdp2", "--optim.lr", "1e-2", "--log-every", "1",
        *extra,
    ]  # fmt: skip
    what = f"the 2-rank `fntrain run hf_causal_lm` under torchrun ({' '.join(extra) or 'FSDP2'})"
    result = run_to_end(command, what, 280, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp_path / "run" / "hf_model"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_fsdp2_fine_tune_saves_a_loadable_model(tiny_hf_model, hf_launch_env, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir, data_path = tiny_hf_model
    out = _fsdp2_fine_tune(model_dir, data_path, tmp_path, hf_launch_env)
    after, before = load_file(out / "model.safetensors"), load_file(model_dir / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(after[name].shape == before[name].shape for name in before)  # full tensors, not shards
    assert any(not torch.equal(before[name], after[name]) for name in before)
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_tensor_parallel_fine_tune_matches_one_process(tiny_hf_model, hf_launch_env, tmp_path):
    """tp 2 (the model's declared transformers plan, vocabulary-parallel loss) trains like one process:
    the same losses, and the exported model has full tensors equal to the one-process run's (SGD: Adam
    would blow float-level gradient differences up to lr-sized ones where the gradient is near 0)."""
    from safetensors.torch import load_file

    model_dir, data_path = tiny_hf_model
    (tmp_path / "tp").mkdir()
    out = _fsdp2_fine_tune(model_dir, data_path, tmp_path / "tp", hf_launch_env, "--parallel.strategy", "none",
                           "--parallel.tp-size", "2", "--optim.name", "sgd")  # fmt: skip
    command = [
        "fntrain", "run", "hf_causal_lm", "--run-dir", str(tmp_path / "one"),
        "--model.path", str(model_dir), "--data.path", str(data_path), "--data.max-length", "48",
        "--train.train-iters", "2", "--train.global-batch-size", "4", "--train.micro-batch-size", "1",
        "--optim.lr", "1e-2", "--log-every", "1", "--optim.name", "sgd",
    ]  # fmt: skip
    what = "the one-process `fntrain run hf_causal_lm` (SGD)"
    result = run_to_end(command, what, 280, cwd=tmp_path, env=hf_launch_env)
    assert result.returncode == 0, result.stderr[-4000:]

    def losses(run_dir: Path) -> list[float]:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [row["loss"] for row in rows if "loss" in row]

    assert losses(tmp_path / "tp" / "run") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    tp, one = (
        load_file(out / "model.safetensors"),
        load_file(tmp_path / "one" / "hf_model" / "model.safetensors"),
    )
    assert tp.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(tp[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- LoRA (the `lora` extra)


def test_lora_flags_are_checked_before_any_model_work(tiny_files, capsys):
    model_dir, data_path = tiny_files
    base = ["--model.path", str(model_dir), "--data.path", str(data_path)]
    for args, words in (
        (["--lora.rank", "-1"], "--lora.rank must be >= 0"),
        (["--lora.rank", "4", "--lora.dropout", "1.0"], "--lora.dropout must be < 1"),
        (["--lora.rank", "4", "--parallel.meta-init"], "--lora.rank > 0 cannot be combined with"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            dispatch(["run", "hf_causal_lm", *base, *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    config = dataclasses.replace(
        hf.Config(model=HFModelConfig(path=str(model_dir)), data=hf.DataConfig(path=str(data_path))),
        lora=LoraConfig(rank=8, target_modules=("q_proj", "v_proj"), merge_on_export=True),
    )
    config.validate()
    assert hf.spec.describe(config)["lora_rank"] == 8


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_two_rank_fsdp2_lora_saves_a_loadable_adapter(tiny_hf_model, hf_launch_env, tmp_path, merge):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir, data_path = tiny_hf_model
    lora = ["--lora.rank", "4", "--lora.target-modules", "q_proj", "v_proj", "--progress.no-enabled"]
    out = _fsdp2_fine_tune(
        model_dir, data_path, tmp_path, hf_launch_env, *lora, *(["--lora.merge-on-export"] if merge else [])
    )
    before = load_file(model_dir / "model.safetensors")
    if merge:
        after = load_file(out / "model.safetensors")
        assert before.keys() == after.keys()
        assert all(after[name].shape == before[name].shape for name in before)  # full tensors, not shards
        changed = {name for name in before if not torch.equal(before[name], after[name])}
        assert changed and all(name.endswith(("q_proj.weight", "v_proj.weight")) for name in changed)
        AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
        return
    from peft import PeftModel

    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_A" in key or "lora_B" in key for key in adapter)
    # full [rank, in] tensors, not shards
    assert all(t.shape[0] == 4 for key, t in adapter.items() if "lora_A" in key)
    assert any(t.abs().sum() > 0 for key, t in adapter.items() if "lora_B" in key)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    PeftModel.from_pretrained(base, out, local_files_only=True)
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_continued_pretraining_on_token_shards_and_a_padded_run_evaluate_and_count_flops(
    tiny_hf_model, tmp_path, caplog
):
    """[issue 27] --data.shards: shards `fntrain tokenize` wrote with the model's tokenizer train in
    max_length windows, every token a target; a validation split alone turns evaluation on; FLOPs per
    token are measured on the padded chat data with no warning; a tokenizer larger than the model is
    refused in one line."""
    import logging

    from fntrain.data.tokenize import tokenize_files

    model_dir, data_path = tiny_hf_model
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_text()[:8_000])
    index = tokenize_files([corpus], tmp_path / "shards", str(model_dir))
    base = hf_run_config(model_dir, data_path, tmp_path / "run")
    config = dataclasses.replace(base, data=hf.DataConfig(shards=str(tmp_path / "shards"), max_length=32,
                                                          val_fraction=0.1))  # fmt: skip
    with caplog.at_level(logging.INFO):
        run_job(config, hf.spec)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["consumed_tokens"] == 3 * 4 * 31  # every token after a window's first
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2, 3]  # 3 steps: every step and the end
    assert "evaluating on" in caplog.text and "every 1 steps and at the end" in caplog.text
    windows = len(hf.build_datasets(config, None)[0]) + len(hf.build_datasets(config, None)[1])
    assert windows == (index.total_tokens - 32) // 31 + 1

    caplog.clear()  # padded chat data: FLOPs measured, batches padded to multiples of 8 only
    padded = dataclasses.replace(base, run_dir=str(tmp_path / "padded"),
                                 data=dataclasses.replace(base.data, val_fraction=0.25, max_length=128))  # fmt: skip
    with caplog.at_level(logging.INFO):
        run_job(padded, hf.spec)
    assert "measuring FLOPs per token failed" not in caplog.text and "FLOPs per token" in caplog.text
    last = [json.loads(line) for line in (tmp_path / "padded" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "val_loss" in last
    collate = hf.spec.collate(padded, hf.build_assets(padded))
    sample, _ = hf.build_datasets(padded, hf.build_assets(padded))
    shape = collate([sample[0], sample[1]])["input_ids"].shape
    assert shape[1] % 8 == 0 and shape[1] < 128

    small = json.loads((model_dir / "config.json").read_text())
    small_dir = tmp_path / "small_vocab"
    shutil.copytree(model_dir, small_dir)
    (small_dir / "config.json").write_text(json.dumps({**small, "vocab_size": 100}))
    with pytest.raises(Exception, match="data.shards .* token ids up to"):
        hf.check(dataclasses.replace(config, model=HFModelConfig(path=str(small_dir))), None)
