"""LoRA through peft (`fntrain.models.lora`): its settings and their errors (fast); (slow tier) a real
tiny Llama wrapped by peft: only the adapter trains and has optimizer state, a resume is bitwise exact,
and the adapter and the merged export load with peft and transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fntrain.config import ConfigError
from fntrain.models.lora import LoraConfig, check_lora_parallel, check_lora_targets

ROOT = Path(__file__).resolve().parents[2]


def lora_built_for(config, spec):
    """What a run builds for `config` in one process, after its phase-1 checks."""
    from fntrain.run.build import build_job
    from fntrain.run.checks import check_run
    from fntrain.runtime import Runtime

    return build_job(config, spec, Runtime(), check_run(config, spec))


def test_defaults_are_off_and_valid():
    config = LoraConfig()
    config.validate()
    assert not config.enabled and LoraConfig(rank=8).enabled


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"rank": -1}, ValueError, "lora.rank"),
        ({"rank": 2.0}, TypeError, "lora.rank must be an int"),
        ({"alpha": 0.0}, ValueError, "lora.alpha"),
        ({"dropout": 1.0}, ValueError, "lora.dropout must be < 1"),
        ({"dropout": -0.1}, ValueError, "lora.dropout"),
        ({"target_modules": ()}, ValueError, "lora.target_modules must be one or more"),
        ({"target_modules": ("q_proj", "")}, ValueError, "lora.target_modules"),
        ({"target_modules": ("all-linear", "q_proj")}, ValueError, "all-linear stands alone"),
        ({"merge_on_export": 1}, TypeError, "lora.merge_on_export must be a bool"),
    ],
)
def test_bad_values_name_the_field(change, error, words):
    with pytest.raises(error, match=words):
        dataclasses.replace(LoraConfig(), **change).validate()
    with pytest.raises(error, match=words.replace("lora.", "adapter.")):
        dataclasses.replace(LoraConfig(), **change).validate("adapter")


def test_missing_peft_is_a_setting_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r"lora.rank 4 needs the peft library: pip install 'fntrain\[lora\]'"
    ):
        LoraConfig(rank=4).validate()
    LoraConfig(rank=0).validate()  # off: peft not needed


def test_meta_init_is_refused_with_lora():
    check_lora_parallel(LoraConfig(), meta_init=True)
    check_lora_parallel(LoraConfig(rank=4), meta_init=False)
    with pytest.raises(ValueError, match="lora.rank > 0 cannot be combined with parallel.meta_init"):
        check_lora_parallel(LoraConfig(rank=4), meta_init=True)
    check_lora_parallel(LoraConfig(), meta_init=False, tp_size=2)
    with pytest.raises(ValueError, match=r"lora.rank > 0 cannot be combined with parallel.tp_size=2"):
        check_lora_parallel(LoraConfig(rank=4), meta_init=False, tp_size=2)


def _tiny_llama_factory():
    """A 1-layer Llama built from its config alone (the check builds it on the meta device)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    return lambda: LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "targets", [("q_proj", "v_proj"), ("all-linear",), ("mlp.down_proj",), ("lm_head",), ()]
)
def test_lora_targets_that_name_layers_pass(targets):
    check_lora_targets(_tiny_llama_factory(), targets)


@pytest.mark.parametrize(
    "targets, message",
    [
        (("nonexistent_proj",), r"lora.target_modules 'nonexistent_proj' matches no layer of the model; its "
                                r"linear, embedding and convolution layers are named down_proj, embed_tokens, .*q_proj"),
        (("q_proj", "qproj"), r"lora.target_modules 'qproj' matches no layer"),
        (("mlp",), r"lora.target_modules 'mlp' matches model.layers.0.mlp \(LlamaMLP\), which LoRA cannot adapt"),
        (("proj",), r"'proj' matches no layer"),  # a suffix counts only as a whole dotted part, as in peft
    ],
)  # fmt: skip
def test_lora_targets_missing_from_the_model_are_setting_errors_before_any_weight(targets, message):
    """The check peft would fail at load time (NoMatchingPeftModuleError), done on a meta copy built
    from the config: no weights read, no memory."""
    built = []

    def factory():
        model = _tiny_llama_factory()()
        built.append(next(model.parameters()).device.type)
        return model

    with pytest.raises(ConfigError, match=message):
        check_lora_targets(factory, targets, field="lora.target_modules")
    assert built == ["meta"]


def test_lora_targets_take_a_built_model_and_name_the_field_given():
    from torch import nn

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    check_lora_targets(model, ("0",))
    with pytest.raises(ConfigError, match=r"adapter.targets '1' matches 1 \(ReLU\), which LoRA cannot adapt"):
        check_lora_targets(model, ("1",), field="adapter.targets")
    with pytest.raises(ConfigError, match="adapter.targets all-linear: the model has no linear layer"):
        check_lora_targets(nn.Sequential(nn.ReLU()), ("all-linear",), field="adapter.targets")


# ----------------------------------------------------------------------------- slow: real peft


@pytest.fixture(scope="module")
def llama_and_chats(tmp_path_factory):
    from tests.helpers.hf import CHATS, save_tiny_llama

    root = tmp_path_factory.mktemp("lora")
    text = (ROOT / "fntrain" / "data" / "corpora" / "shakespeare.txt").read_text()[:40_000]
    model_dir = save_tiny_llama(root / "model", text.splitlines(), vocab_size=300, max_positions=128)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    chats = [CHATS[0]] + [
        [{"role": "user", "content": lines[2 * i]}, {"role": "assistant", "content": lines[2 * i + 1]}]
        for i in range(15)
    ]
    data_path = root / "chat.jsonl"
    data_path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return model_dir, data_path


def lora_run_config(model_dir: Path, data_path: Path, run_dir: Path, *, iters: int = 3, **lora):
    from fntrain.hooks.progress import ProgressConfig
    from fntrain.models.hf_config import HFModelConfig
    from fntrain.run.config import CheckpointConfig, TrainConfig
    from fntrain.step.optim import OptimizerConfig, ScheduleConfig
    from recipes import hf_causal_lm as hf

    return hf.Config(
        run_dir=str(run_dir),
        log_every=1,
        model=HFModelConfig(path=str(model_dir)),
        data=hf.DataConfig(path=str(data_path), max_length=48),
        train=TrainConfig(train_iters=iters, global_batch_size=4, micro_batch_size=2),
        optim=OptimizerConfig(lr=1e-2, weight_decay=0.0),
        schedule=ScheduleConfig(lr_schedule_iters=4),  # the same schedule for a 2-step and a 4-step run
        progress=ProgressConfig(enabled=False),
        checkpoint=CheckpointConfig(save_every=2, export=False),
        lora=LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), **lora),
    )


@pytest.mark.slow
def test_only_the_adapter_trains_and_has_optimizer_state(llama_and_chats):
    from recipes import hf_causal_lm as hf

    model_dir, data_path = llama_and_chats
    built = lora_built_for(lora_run_config(model_dir, data_path, Path("unused")), hf.spec)
    model, optimizer = built.components.model, built.components.optimizers[0]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    assert all(name.endswith(("q_proj.lora_A.default.weight", "q_proj.lora_B.default.weight",
                              "v_proj.lora_A.default.weight", "v_proj.lora_B.default.weight"))
               for name in trainable)  # fmt: skip
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    # Seeded adapter initialisation: the same on every build (every rank), whatever drew from the RNG.
    torch.rand(5)
    again = lora_built_for(lora_run_config(model_dir, data_path, Path("unused")), hf.spec).components.model
    for (name, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name


def _adapter(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_resume_bitwise_and_export_the_adapter(llama_and_chats, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fntrain.run.job import run_job
    from recipes import hf_causal_lm as hf

    model_dir, data_path = llama_and_chats
    # Straight through: 4 steps.
    straight = lora_run_config(model_dir, data_path, tmp_path / "straight", iters=4)
    captured = {}
    spec = dataclasses.replace(hf.spec, export=lambda c, built, s: captured.update(model=built.components.model)
                               or hf.export(c, built, s))  # fmt: skip
    assert run_job(straight, spec).state.global_step == 4
    base_before = load_file(model_dir / "model.safetensors")
    final = captured["model"]
    for name, tensor in final.get_base_model().state_dict().items():
        key = name.replace(".base_layer", "")
        if key in base_before:
            assert torch.equal(tensor, base_before[key]), f"frozen weight {name} changed"
    lora_b = [p for name, p in final.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: the adapter trained

    # Interrupted after step 2 (its checkpoint), then resumed to step 4: bitwise the same adapter.
    first = lora_run_config(model_dir, data_path, tmp_path / "resumed", iters=2)
    run_job(first, hf.spec)
    resumed_config = dataclasses.replace(
        lora_run_config(model_dir, data_path, tmp_path / "resumed", iters=4),
        checkpoint=dataclasses.replace(
            first.checkpoint, restore_from="latest", allow_changes=("train.train_iters",)
        ),
    )
    spec_resumed = dataclasses.replace(hf.spec, export=lambda c, built, s: captured.update(resumed=built.components.model)
                                       or hf.export(c, built, s))  # fmt: skip
    assert run_job(resumed_config, spec_resumed).state.global_step == 4
    expected, got = _adapter(final), _adapter(captured["resumed"])
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name

    # The adapter export: PEFT layout, loadable by peft and by transformers (with peft installed).
    out = tmp_path / "straight" / "hf_model"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    saved = load_file(out / "adapter_model.safetensors")
    assert saved and all("lora_" in key for key in saved)
    ids = torch.tensor([[1, 5, 9, 23, 42, 7]])
    final.eval()
    with torch.no_grad():
        want = final(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        peft_model = PeftModel.from_pretrained(base, out, local_files_only=True).eval()
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        direct = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        torch.testing.assert_close(direct(input_ids=ids).logits, want, atol=1e-5, rtol=0)

    # The merged export: a plain save_pretrained model with the same logits.
    merged_config = dataclasses.replace(straight, lora=dataclasses.replace(straight.lora, merge_on_export=True),
                                        run_dir=str(tmp_path / "merged"))  # fmt: skip
    built = lora_built_for(merged_config, hf.spec)
    for name, p in built.components.model.named_parameters():
        if "lora_" in name:
            p.data.copy_(dict(final.named_parameters())[name])
    merged_dir = hf.export(merged_config, built, None)
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True).eval()
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
    assert any("lora_" in n for n, _ in built.components.model.named_parameters())  # trained model untouched
