"""The Hugging Face causal-LM recipe: data transform and label masking (fast, with a stand-in
tokenizer), and (slow tier) a real tiny Llama + BPE tokenizer built in the test, fine-tuned 3 steps on
chat JSONL, reloaded with transformers; its plan; a 2-rank FSDP2 fine-tune under torchrun."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch

from fntrain.data.tokens import IGNORE_INDEX
from recipes import hf_causal_lm as hf

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A king."}],
    [
        {"role": "system", "content": "Speak as a bard."},
        {"role": "user", "content": "Hail!"},
        {"role": "assistant", "content": "Well met."},
        {"role": "user", "content": "Sing."},
        {"role": "assistant", "content": "La la."},
    ],
]


class CharTokenizer:
    """A stand-in for a Hugging Face tokenizer: one token per character, <s> </s> <pad> special."""

    SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2}
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, *, is_fast: bool = True, chat_template: str | None = TEMPLATE):
        self.is_fast = is_fast
        self.chat_template = chat_template

    def __len__(self) -> int:
        return 300

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets, position = [], [], 0
        while position < len(text):
            special = next((s for s in self.SPECIAL if text.startswith(s, position)), None)
            if special:
                ids.append(self.SPECIAL[special])
                offsets.append((position, position + len(special)))
                position += len(special)
            else:
                ids.append(ord(text[position]) + 10)
                offsets.append((position, position + 1))
                position += 1
        return ids, offsets

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids, offsets = self._encode(text)
        if add_special_tokens:
            ids, offsets = [self.bos_token_id, *ids], [(0, 0), *offsets]
        out = {"input_ids": ids}
        if return_offsets_mapping:
            assert self.is_fast, "a slow tokenizer has no offsets"
            out["offset_mapping"] = offsets
        return out

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        template = jinja2.Environment().from_string(self.chat_template)
        return template.render(
            messages=messages, bos_token="<s>", add_generation_prompt=add_generation_prompt
        )

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.SPECIAL.items()}
        return "".join(names.get(i, chr(i - 10) if i >= 10 else "?") for i in ids)


def assets_of(tokenizer) -> hf.ModelAssets:
    return hf.ModelAssets(tokenizer, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.chat_template)


def trained_text(example: hf.Example, tokenizer) -> str:
    return tokenizer.decode([label for label in example.labels if label != IGNORE_INDEX])


# ----------------------------------------------------------------------------- fast: transform and masking


@pytest.mark.parametrize("is_fast", [True, False])
def test_chat_labels_mask_every_prompt_token(is_fast):
    tokenizer = CharTokenizer(is_fast=is_fast)
    data = hf.HFDataConfig()
    single = hf.transform_example({"messages": CHATS[0]}, assets_of(tokenizer), data)
    assert (
        tokenizer.decode(single.input_ids) == "<s><|user|>\nWho art thou?</s>\n<|assistant|>\nA king.</s>\n"
    )
    # Only the reply and its end-of-turn marker are trained on; the BOS, roles and user turn are not.
    assert trained_text(single, tokenizer) == "A king.</s>\n"
    first_trained = next(i for i, label in enumerate(single.labels) if label != IGNORE_INDEX)
    assert tokenizer.decode(single.input_ids[:first_trained]).endswith("<|assistant|>\n")
    assert all(
        label in (IGNORE_INDEX, token) for token, label in zip(single.input_ids, single.labels, strict=True)
    )

    multi = hf.transform_example({"messages": CHATS[1]}, assets_of(tokenizer), data)
    assert trained_text(multi, tokenizer) == "Well met.</s>\nLa la.</s>\n"
    everything = hf.transform_example(
        {"messages": CHATS[1]}, assets_of(tokenizer), dataclasses.replace(data, train_on_prompt=True)
    )
    assert everything.labels == everything.input_ids


def test_prompt_completion_and_text_examples():
    tokenizer = CharTokenizer()
    data = hf.HFDataConfig()
    pair = hf.transform_example({"prompt": "Q: 2+2? A:", "completion": " 4"}, assets_of(tokenizer), data)
    assert tokenizer.decode(pair.input_ids) == "<s>Q: 2+2? A: 4</s>"
    assert trained_text(pair, tokenizer) == " 4</s>"
    text = hf.transform_example({"text": "To be."}, assets_of(tokenizer), data)
    assert text.labels == text.input_ids and tokenizer.decode(text.input_ids) == "<s>To be.</s>"
    no_eos = hf.transform_example(
        {"text": "To be."}, assets_of(tokenizer), dataclasses.replace(data, add_eos=False)
    )
    assert tokenizer.decode(no_eos.input_ids) == "<s>To be."
    custom = dataclasses.replace(data, format="prompt_completion", prompt_key="q", completion_key="a")
    assert (
        trained_text(hf.transform_example({"q": "x", "a": "y"}, assets_of(tokenizer), custom), tokenizer)
        == "y</s>"
    )


def test_transform_errors_name_the_example():
    tokenizer = CharTokenizer()
    data = hf.HFDataConfig()
    with pytest.raises(ValueError, match="cannot tell the format"):
        hf.transform_example({"body": "x"}, assets_of(tokenizer), data, where="example 3")
    with pytest.raises(ValueError, match="example 3: 'text' must be a str"):
        hf.transform_example({"text": 5}, assets_of(tokenizer), data, where="example 3")
    with pytest.raises(ValueError, match="message 0 must be an object"):
        hf.transform_example({"messages": ["hi"]}, assets_of(tokenizer), data)
    with pytest.raises(ValueError, match="set assets.chat_template"):
        hf.transform_example({"messages": CHATS[0]}, assets_of(CharTokenizer(chat_template=None)), data)
    odd = CharTokenizer(chat_template="{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="prefixes"):
        hf.transform_example({"messages": CHATS[0]}, assets_of(odd), data)


def test_examples_without_trained_tokens_are_dropped_and_padding_collates(tmp_path):
    tokenizer = CharTokenizer()
    path = tmp_path / "data.jsonl"
    lines = [{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "no reply"}]}, {"text": "Hi"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    data = hf.HFDataConfig(path=str(path), max_length=40)
    examples = hf.build_examples(hf.read_jsonl(str(path)), assets_of(tokenizer), data)
    assert len(examples) == 2  # the chat with no assistant turn trains on nothing

    dataset = hf.build_dataset(examples, data)
    assert len(dataset) == 2 and dataset.truncated == 1  # the first chat is longer than 40 tokens
    batch = hf.make_collate(0, max_length=40)([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (2, 40)
    length = len(examples[1].input_ids)
    assert batch["attention_mask"][1].tolist() == [1] * length + [0] * (40 - length)
    assert (batch["labels"][1, length:] == IGNORE_INDEX).all() and (batch["input_ids"][1, length:] == 0).all()
    assert batch["labels"][1, :length].tolist() == list(examples[1].labels)
    longest = hf.make_collate(0, max_length=40, pad_to="longest")([dataset[1]])
    assert longest["input_ids"].shape == (1, length) and "attention_mask" not in longest


def test_packing_concatenates_into_full_windows():
    tokenizer = CharTokenizer()
    data = hf.HFDataConfig(packing=True, max_length=16)
    examples = [hf.transform_example({"messages": chat}, assets_of(tokenizer), data) for chat in CHATS]
    dataset = hf.build_dataset(examples, data)
    total = sum(len(e.input_ids) for e in examples)
    assert len(dataset) == total // 16 and dataset.dropped_tokens == total % 16
    flat_ids = [t for e in examples for t in e.input_ids]
    flat_labels = [t for e in examples for t in e.labels]
    assert dataset[1]["input_ids"].tolist() == flat_ids[16:32]
    assert dataset[1]["labels"].tolist() == flat_labels[16:32]
    batch = hf.make_collate(0, max_length=16)([dataset[0], dataset[1]])
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (2, 16)
    with pytest.raises(ValueError, match="fewer than data.max_length"):
        hf.build_dataset(examples, dataclasses.replace(data, max_length=10_000))


def test_bad_jsonl_lines_are_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        hf.read_jsonl(str(path))
    path.write_text('{"text": "a"}\n[1]\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object"):
        hf.read_jsonl(str(path))
    with pytest.raises(FileNotFoundError, match="data.path"):
        hf.read_jsonl(str(tmp_path / "missing.jsonl"))


def test_missing_local_model_is_a_clear_error_never_a_download(tmp_path, monkeypatch):
    for name in hf.OFFLINE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        FileNotFoundError, match="model.path 'meta-llama/Llama-3-8B' is not a local directory"
    ):
        hf.load_model(hf.HFModelConfig(path="meta-llama/Llama-3-8B"), torch.device("cpu"))
    assert all(os.environ[name] == "1" for name in hf.OFFLINE_SWITCHES)
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="lacks config.json"):
        hf.load_model(hf.HFModelConfig(path=str(tmp_path / "m")), torch.device("cpu"))
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        hf.load_model(hf.HFModelConfig(path=str(tmp_path / "m")), torch.device("cpu"))
    config = hf.HFCausalLMConfig(
        model=hf.HFModelConfig(path=str(tmp_path / "nope")), data=hf.HFDataConfig(path="x")
    )
    with pytest.raises(FileNotFoundError, match="model.path"):
        hf.build_model_assets(config)


def test_config_validation_names_fields():
    with pytest.raises(ValueError, match="model.path is required"):
        hf.HFCausalLMConfig().validate()
    base = hf.HFCausalLMConfig(model=hf.HFModelConfig(path="m"), data=hf.HFDataConfig(path="d.jsonl"))
    base.validate()
    with pytest.raises(ValueError, match="data.max_length must be >= 2"):
        dataclasses.replace(base, data=dataclasses.replace(base.data, max_length=1)).validate()
    with pytest.raises(TypeError, match="data.packing must be a bool"):
        dataclasses.replace(base, data=dataclasses.replace(base.data, packing=1)).validate()
    assert hf.output_dir(base) == Path("runs/hf_causal_lm/hf_model")
    assert hf.output_dir(dataclasses.replace(base, output_dir="/abs/out")) == Path("/abs/out")


# ----------------------------------------------------------------------------- slow: real transformers


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A tiny Llama and a BPE tokenizer trained on a slice of the bundled corpus, saved with
    save_pretrained; plus a chat JSONL file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hf")
    text = (ROOT / "recipes" / "data" / "shakespeare.txt").read_text()[:60_000]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(text.splitlines(), trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model_dir = root / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

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


def _config(model_dir: Path, data_path: Path, run_dir: Path, **data) -> hf.HFCausalLMConfig:
    return hf.HFCausalLMConfig(
        run_dir=str(run_dir),
        log_every=1,
        model=hf.HFModelConfig(path=str(model_dir)),
        data=hf.HFDataConfig(path=str(data_path), max_length=48, **data),
        train=hf.HFTrainConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        optim=hf.OptimizerConfig(lr=1e-2, weight_decay=0.0),
        progress=hf.ProgressConfig(enabled=False),
    )


@pytest.mark.slow
def test_fine_tune_three_steps_then_reload_with_transformers(tiny_hf_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, data_path = tiny_hf_model
    config = dataclasses.replace(
        _config(model_dir, data_path, tmp_path / "run", val_fraction=0.25),
        evaluate=hf.EvaluateConfig(at_end=True),
        checkpoint=hf.CheckpointConfig(save_every=2, export=False),
    )
    state = hf.run(config)
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
    from fntrain.config_file import load_config

    assert load_config(hf.HFCausalLMConfig, tmp_path / "run" / "config.json") == config

    # The run checkpointed at step 2 and at its end; a longer run resumes from the latest one.
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    longer = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, train_iters=4),
        checkpoint=dataclasses.replace(config.checkpoint, restore_from="latest"),
    )
    assert hf.run(longer).global_step == 4
    steps = [
        json.loads(line).get("step") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps.count(4) >= 1 and steps.count(1) == 1  # resumed at step 3, not from scratch


@pytest.mark.slow
def test_real_tokenizer_masks_prompt_tokens(tiny_hf_model):
    from transformers import AutoTokenizer

    model_dir, _ = tiny_hf_model
    config = hf.HFCausalLMConfig(model=hf.HFModelConfig(path=str(model_dir)))
    assets = hf.build_model_assets(config)
    assert (
        isinstance(assets.tokenizer, type(AutoTokenizer.from_pretrained(model_dir)))
        and assets.tokenizer.is_fast
    )
    example = hf.transform_example({"messages": CHATS[1]}, assets, hf.HFDataConfig())
    trained = assets.tokenizer.decode([label for label in example.labels if label != IGNORE_INDEX])
    assert trained == "Well met.</s>\nLa la.</s>\n"
    override = dataclasses.replace(
        config, assets=hf.AssetsConfig(chat_template="{{ messages[0]['content'] }}")
    )
    assert hf.build_model_assets(override).chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.slow
def test_plan_for_two_ranks_reads_no_weights(tiny_hf_model, monkeypatch, capsys):
    from fntrain.cli import dispatch
    from fntrain.recipes_registry import load_recipe

    model_dir, data_path = tiny_hf_model
    module = load_recipe("hf_causal_lm").module  # fntrain_recipes.hf_causal_lm when installed
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("plan must not load the model"))
    report = dispatch(
        ["plan", "hf_causal_lm", "--world-size", "2", "--model.path", str(model_dir), "--data.path", str(data_path),
         "--data.packing", "--data.max-length", "32", "--train.global-batch-size", "4", "--train.micro-batch-size", "1"]
    )  # fmt: skip
    assets = hf.build_model_assets(_config(model_dir, data_path, Path("unused")))
    packed = hf.build_dataset(
        hf.build_examples(
            hf.read_jsonl(str(data_path)), assets, hf.HFDataConfig(packing=True, max_length=32)
        ),
        hf.HFDataConfig(packing=True, max_length=32),
    )
    assert report["dataset_len"] == len(packed) and report["packing"] is True
    assert (report["dp_size"], report["micro_batches"]) == (2, 2)
    assert report["steps_per_epoch"] == (len(packed) // 2) // 2
    assert "world size          2 (data-parallel 2)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_fsdp2_fine_tune_saves_a_loadable_model(tiny_hf_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun not installed")
    model_dir, data_path = tiny_hf_model
    command = [
        torchrun, "--standalone", "--nproc_per_node", "2", "-m", "fntrain", "run", "hf_causal_lm",
        "--run-dir", str(tmp_path / "run"), "--model.path", str(model_dir), "--data.path", str(data_path),
        "--data.max-length", "48", "--train.train-iters", "2", "--train.global-batch-size", "4",
        "--train.micro-batch-size", "1", "--parallel.strategy", "fsdp2", "--optim.lr", "1e-2", "--log-every", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "run" / "hf_model"
    after, before = load_file(out / "model.safetensors"), load_file(model_dir / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(after[name].shape == before[name].shape for name in before)  # full tensors, not shards
    assert any(not torch.equal(before[name], after[name]) for name in before)
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_validation_split_and_truncated_away_examples(tmp_path):
    tokenizer = CharTokenizer()
    train_path, val_path = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(8)))
    val_path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    config = hf.HFCausalLMConfig(
        model=hf.HFModelConfig(path="m"), data=hf.HFDataConfig(path=str(train_path), val_fraction=0.25)
    )
    train_set, val_set = hf.build_datasets(config, assets_of(tokenizer))
    assert (len(train_set), len(val_set)) == (6, 2)
    assert val_set[1]["input_ids"] == list(
        hf.transform_example({"text": "line 7"}, assets_of(tokenizer), config.data).input_ids
    )
    from_file = dataclasses.replace(config, data=dataclasses.replace(config.data, val_path=str(val_path)))
    train_set, val_set = hf.build_datasets(from_file, assets_of(tokenizer))
    assert (len(train_set), len(val_set)) == (8, 1)
    with pytest.raises(ValueError, match="evaluate needs validation data"):
        dataclasses.replace(
            config, data=hf.HFDataConfig(path="d"), evaluate=hf.EvaluateConfig(eval_every=5)
        ).validate()

    # A completion that starts after max_length leaves nothing to train on once truncated: dropped.
    long_prompt = {"prompt": "x" * 50, "completion": "y"}
    kept = hf.build_examples(
        [long_prompt, {"text": "ok"}], assets_of(tokenizer), hf.HFDataConfig(max_length=20)
    )
    assert len(kept) == 1 and tokenizer.decode(kept[0].input_ids) == "<s>ok</s>"
    packed = hf.build_examples(
        [long_prompt], assets_of(tokenizer), hf.HFDataConfig(max_length=20, packing=True)
    )
    assert len(packed) == 1  # packing keeps every token, so the completion survives
