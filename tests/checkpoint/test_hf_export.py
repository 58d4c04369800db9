"""`fntrain export` (issue 12, item 2): an fntrain DCP checkpoint -> a Hugging Face directory (config +
safetensors, sharded with an index above a size) -> a DCP checkpoint again, weights unchanged. tiny_gpt
checkpoints here; (slow tier) a transformers Llama with tied embeddings, loadable by from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fntrain.checkpoint import SaveTarget, is_complete, restore, save
from fntrain.checkpoint.export_options import ExportOptions, export_checkpoint, parse_size
from fntrain.checkpoint.hf_export import PROVENANCE, SAFE_INDEX, SAFE_WEIGHTS, export_hf
from fntrain.checkpoint.hf_import import import_hf
from fntrain.checkpoint.safe_reader import read_dcp_metadata
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.run.resolved import config_to_dict
from fntrain.state import TrainState
from fntrain.step.components import Components
from recipes.tiny_gpt import Config

MODEL = ModelConfig(context=16, n_layer=2, n_head=2, d_model=32)
STATE = TrainState(epoch=1, global_step=7, cursor=2)


def tiny_components(seed: int = 0) -> Components:
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randint(0, 256, (2, 16))).sum()
    loss.backward()
    optimizer.step()  # optimizer state in the checkpoint too: the export must take the model only
    return Components(model=model, loss_fn=lambda out, batch: out, optimizers=(optimizer,))


@pytest.fixture
def checkpoint_and_components(tmp_path) -> tuple[Path, Components]:
    components = tiny_components()
    root = tmp_path / "checkpoints"
    save(SaveTarget(root, components, config=config_to_dict(Config(model=MODEL))), STATE)
    return root, components


def dcp_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    from fntrain.checkpoint.hf_export import _load_model_keys, _model_tensors

    entries = _model_tensors(path)
    return _load_model_keys(path, entries, list(entries))


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_round_trip_dcp_hf_dcp_leaves_weights_equal(checkpoint_and_components, tmp_path):
    root, components = checkpoint_and_components
    hf_dir = export_hf(root, tmp_path / "hf", max_shard_size=20_000)  # the root: its latest checkpoint
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((hf_dir / SAFE_INDEX).read_text())
    expected = {name: t.detach() for name, t in components.model.state_dict().items()}
    assert set(index["weight_map"]) == set(expected) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for file in files:  # each file stays under the size unless one tensor alone is larger
        tensors = load_file(hf_dir / file)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 20_000 or len(tensors) == 1
    exported = hf_tensors(hf_dir)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name

    back = import_hf(hf_dir, tmp_path / "again")
    assert back == tmp_path / "again" / "step_7" and is_complete(back)
    assert (tmp_path / "again" / "latest").read_text().strip() == "step_7"
    original, returned = dcp_model_tensors(root / "step_7"), dcp_model_tensors(back)
    assert original.keys() == returned.keys()
    for key, tensor in original.items():
        assert torch.equal(returned[key], tensor), key
    assert not any(key.startswith("optimizer") for key in read_dcp_metadata(back).state_dict_metadata)

    # The re-imported checkpoint restores into a fresh model (weights only) with the trained weights.
    fresh = tiny_components(seed=1)
    assert restore(back, fresh, weights_only=True) == TrainState()
    for name, tensor in expected.items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    assert fresh.model.head.weight is fresh.model.tok.weight


def test_tiny_gpt_config_describes_its_own_architecture(checkpoint_and_components, tmp_path):
    root, components = checkpoint_and_components
    hf_dir = export_hf(root / "step_7", tmp_path / "hf")
    assert sorted(p.name for p in hf_dir.iterdir()) == sorted(["config.json", SAFE_WEIGHTS, PROVENANCE])
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "fntrain" and config["dtype"] == "float32"
    assert config["fntrain_model"] == config_to_dict(MODEL)
    assert config["num_parameters"] == sum(t.numel() for t in components.model.state_dict().values())
    rebuilt = TinyGPT(ModelConfig(**config["fntrain_model"]))
    rebuilt.load_state_dict(load_file(hf_dir / SAFE_WEIGHTS))  # every key is there, tied ones included
    ids = torch.randint(0, 256, (1, 16))
    assert torch.equal(rebuilt(ids), components.model(ids))
    provenance = json.loads((hf_dir / PROVENANCE).read_text())
    assert provenance["step"] == 7 and provenance["train_state"] == STATE.as_dict()
    assert provenance["tied"] == {} and provenance["run_config"]["model"] == config_to_dict(MODEL)


def test_dtype_cast_and_step_override(checkpoint_and_components, tmp_path):
    root, components = checkpoint_and_components
    hf_dir = export_checkpoint(root, tmp_path / "hf", ExportOptions(format="hf", dtype="bfloat16"))
    tensors = hf_tensors(hf_dir)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "bfloat16"
    back = export_checkpoint(hf_dir, tmp_path / "dcp", ExportOptions(format="dcp", dtype="float32", step=0))
    assert back.name == "step_0"
    weight = components.model.tok.weight.detach()
    assert torch.equal(dcp_model_tensors(back)["model.tok.weight"], weight.to(torch.bfloat16).float())


def test_outputs_are_never_overwritten_silently_and_sources_are_checked(checkpoint_and_components, tmp_path):
    root, _ = checkpoint_and_components
    hf_dir = export_hf(root, tmp_path / "hf")
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(root, hf_dir)
    export_hf(root, hf_dir, overwrite=True)
    with pytest.raises(ValueError, match="is an fntrain checkpoint"):
        import_hf(root / "step_7", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_hf(tmp_path / "nowhere", tmp_path / "y")
    config = config_to_dict(Config(model=MODEL))
    config["model"] = {"path": str(tmp_path / "gone")}  # an HF run whose model directory moved
    save(SaveTarget(tmp_path / "hfrun", tiny_components(), config=config), STATE)
    with pytest.raises(FileNotFoundError, match="model_dir"):
        export_hf(tmp_path / "hfrun", tmp_path / "z")


def test_sizes_and_options_are_validated():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6 and parse_size("1024") == 1024 and parse_size(7) == 7
    with pytest.raises(ValueError, match=r"export\.max_shard_size .* got 'lots'"):
        parse_size("lots")
    with pytest.raises(ValueError, match=r"export\.format"):
        ExportOptions(format="onnx").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"export\.step"):
        ExportOptions(step=-1).validate()
    with pytest.raises(ValueError, match=r"export\.max_shard_size must be at least 1"):
        ExportOptions(max_shard_size="0").validate()


def test_fntrain_export_command(checkpoint_and_components, tmp_path, capsys):
    from fntrain.cli import dispatch

    root, components = checkpoint_and_components
    out = dispatch(["export", str(root), "--format", "hf", str(tmp_path / "hf"), "--max-shard-size", "30KB"])
    assert out == tmp_path / "hf" and str(out) in capsys.readouterr().out
    assert (out / SAFE_INDEX).is_file()
    back = dispatch(["export", str(out), "--format", "dcp", str(tmp_path / "dcp")])
    assert torch.equal(dcp_model_tensors(back)["model.ln_f.weight"], components.model.ln_f.weight.detach())
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["export", str(root), "--format", "hf", str(out)])  # occupied output: a message, status 2
    assert exit_info.value.code == 2 and "not empty" in capsys.readouterr().err


# ----------------------------------------------------------------------------- slow: transformers


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hf_model_checkpoint_exports_to_a_from_pretrained_directory_and_back(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from fntrain.models.hf_config import HFModelConfig
    from recipes import hf_causal_lm as hf

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model_dir = tmp_path / "base"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))

    # A "fine-tuned" model: the base with changed weights, checkpointed as the hf_causal_lm recipe does.
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    run_config = config_to_dict(hf.Config(model=HFModelConfig(path=str(model_dir))))
    components = Components(model=model, loss_fn=lambda out, batch: out, optimizers=())
    save(SaveTarget(tmp_path / "ckpt", components, config=run_config), STATE)

    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=40_000)
    names = set(json.loads((out / SAFE_INDEX).read_text())["weight_map"])
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: written once
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    assert json.loads((out / PROVENANCE).read_text())["tied"] == {
        "lm_head.weight": "model.embed_tokens.weight"
    }
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 9, 30, 77, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)

    back = import_hf(out, tmp_path / "again")
    original, returned = dcp_model_tensors(tmp_path / "ckpt" / "step_7"), dcp_model_tensors(back)
    assert original.keys() == returned.keys()  # lm_head.weight is back under its own name
    for key, tensor in original.items():
        assert torch.equal(returned[key], tensor), key


# ----------------------------------------------------------------------------- a recipe's conversion


def _tiny_gpt_run(tmp_path: Path) -> Path:
    """A 2-step tiny_gpt run with a checkpoint at its end and its own hf_model; returns the run dir."""
    import dataclasses

    from fntrain.hooks.evaluate import EvaluateConfig
    from fntrain.hooks.progress import ProgressConfig
    from fntrain.run.job import run_job
    from recipes import tiny_gpt

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 40)
    base = tiny_gpt.Config()
    config = dataclasses.replace(
        base, run_dir=str(tmp_path / "run"), log_every=0, model=MODEL,
        data=dataclasses.replace(base.data, path=str(corpus)),
        train=dataclasses.replace(base.train, train_iters=2, global_batch_size=2, micro_batch_size=2),
        checkpoint=dataclasses.replace(base.checkpoint, save_every=2, export=False),
        evaluate=EvaluateConfig(), progress=ProgressConfig(enabled=False),
    )  # fmt: skip
    run_job(config, tiny_gpt.spec)
    return tmp_path / "run"


@pytest.fixture
def tiny_gpt_run(tmp_path) -> Path:
    return _tiny_gpt_run(tmp_path)


def test_a_tiny_gpt_checkpoint_exports_as_the_runs_own_gpt2(tiny_gpt_run, tmp_path, capsys):
    """[issue 27] `fntrain export CKPT --format hf OUT` of a tiny GPT writes what its run's hf_model
    holds (a GPT-2: same config, same tensors, the tied head once), through the recipe the checkpoint's
    meta.json records."""
    from fntrain.cli import dispatch

    root = tiny_gpt_run / "checkpoints"
    assert json.loads((root / "step_2" / "meta.json").read_text())["recipe"] == "recipes.tiny_gpt"
    out = dispatch(["export", str(root), "--format", "hf", str(tmp_path / "hf")])
    own = tiny_gpt_run / "hf_model"
    config, run_config = (json.loads((d / "config.json").read_text()) for d in (out, own))
    assert config == run_config and config["model_type"] == "gpt2"
    exported, expected = load_file(out / SAFE_WEIGHTS), load_file(own / SAFE_WEIGHTS)
    assert exported.keys() == expected.keys() and "lm_head.weight" not in exported
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    tiny = TinyGPT(MODEL)
    untied = sum(p.numel() for p in tiny.parameters())  # the tied head counted once
    assert sum(t.numel() for t in exported.values()) == untied
    provenance = json.loads((out / PROVENANCE).read_text())
    assert provenance["converted"] and provenance["recipe"] == "recipes.tiny_gpt"

    with pytest.raises(SystemExit):  # the way back needs the recipe's own names
        dispatch(["export", str(out), "--format", "dcp", str(tmp_path / "dcp")])
    assert "--recipe none" in capsys.readouterr().err
    raw = dispatch(["export", str(root), "--format", "hf", str(tmp_path / "raw"), "--recipe", "none"])
    assert json.loads((raw / "config.json").read_text())["model_type"] == "fntrain"
    back = dispatch(["export", str(raw), "--format", "dcp", str(tmp_path / "dcp")])
    assert is_complete(back)


def test_export_names_a_recipe_that_does_not_load(checkpoint_and_components, tmp_path, capsys):
    from fntrain.cli import dispatch

    root, _ = checkpoint_and_components
    with pytest.raises(SystemExit) as exit_info:
        dispatch(["export", str(root), "--format", "hf", str(tmp_path / "hf"), "--recipe", "no_such_recipe"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--recipe 'no_such_recipe'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()
    # --recipe on a checkpoint that records none (saved by hand): converted all the same (the checkout's
    # module, as an installed fntrain_recipes may be another checkout's)
    out = dispatch(["export", str(root), "--format", "hf", str(tmp_path / "hf"), "--recipe", "recipes.tiny_gpt"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_exported_tiny_gpt_loads_in_transformers_with_the_runs_logits(tiny_gpt_run, tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    from fntrain.cli import dispatch

    out = dispatch(["export", str(tiny_gpt_run / "checkpoints"), "--format", "hf", str(tmp_path / "hf")])
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    own = AutoModelForCausalLM.from_pretrained(tiny_gpt_run / "hf_model", local_files_only=True).eval()
    assert isinstance(exported, GPT2LMHeadModel)
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()  # tied, not copied
    ids = torch.randint(0, 256, (2, MODEL.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, own(input_ids=ids).logits)
