"""`fntrain.checkpoint.hf_export` paths the tiny_gpt round trip (test_hf_export.py) leaves out, all in
one process: a Hugging Face model's checkpoint (a tiny tied Llama built from its config) exports with
the model directory's config (dtype set), generation config and the run's tokenizer files, the tied
head written once, found from the run config or from --model-dir; the way back re-ties from config.json
when the provenance file is gone. Integer tensors keep their dtype; every refused input names itself;
a failed export leaves nothing behind; hand-written safetensors files (unaligned, unknown dtype, a name
in two files) are read or refused."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fntrain.checkpoint import SaveTarget, hf_export, save
from fntrain.checkpoint.hf_export import PROVENANCE, SAFE_WEIGHTS, export_hf
from fntrain.checkpoint.hf_import import import_hf
from fntrain.config import ConfigError
from fntrain.state import TrainState
from fntrain.step.components import Components
from tests.checkpoint.test_hf_export import dcp_model_tensors

STATE = TrainState(epoch=0, global_step=3, cursor=1)


def model_components(model: torch.nn.Module) -> Components:
    return Components(model=model, loss_fn=lambda out, batch: out, optimizers=())


@pytest.fixture
def llama_run(tmp_path):
    """(checkpoint root, model dir, tokenizer dir, model): a tied tiny Llama saved with save_pretrained,
    checkpointed with a run config naming both directories."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model_dir, tokenizer_dir = tmp_path / "base", tmp_path / "tokenizer"
    model.save_pretrained(model_dir)
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    run_config = {"model": {"path": str(model_dir)}, "assets": {"tokenizer_path": str(tokenizer_dir)}}
    save(SaveTarget(tmp_path / "ckpt", model_components(model), config=run_config), STATE)
    return tmp_path / "ckpt", model_dir, tokenizer_dir, model


def test_an_hf_models_checkpoint_exports_with_its_files_and_ties(llama_run, tmp_path):
    root, model_dir, _, model = llama_run
    out = export_hf(root, tmp_path / "hf", dtype=torch.bfloat16)
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        SAFE_WEIGHTS,
        PROVENANCE,
    } == names
    weights = load_file(out / SAFE_WEIGHTS)
    assert "lm_head.weight" not in weights and {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(
        weights["model.embed_tokens.weight"], model.model.embed_tokens.weight.detach().bfloat16()
    )
    source_config = json.loads((model_dir / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    key = "dtype" if "dtype" in source_config or "torch_dtype" not in source_config else "torch_dtype"
    assert config[key] == "bfloat16" and config["model_type"] == "llama"
    assert json.loads((out / PROVENANCE).read_text())["tied"] == {
        "lm_head.weight": "model.embed_tokens.weight"
    }

    # The same from --model-dir, the run config's path gone; then back, re-tied from config.json alone.
    shutil.copytree(model_dir, tmp_path / "moved")
    shutil.rmtree(model_dir)
    again = export_hf(root, tmp_path / "hf", model_dir=str(tmp_path / "moved"), overwrite=True)
    (again / PROVENANCE).unlink()
    back = import_hf(again, tmp_path / "dcp")
    assert back.name == "step_0"  # no provenance: no step to keep
    tensors = dcp_model_tensors(back)
    assert torch.equal(tensors["model.lm_head.weight"], tensors["model.model.embed_tokens.weight"])
    assert torch.equal(tensors["model.lm_head.weight"], model.lm_head.weight.detach())


def test_a_model_dir_without_config_json_is_refused(llama_run, tmp_path):
    root, *_ = llama_run
    with pytest.raises(FileNotFoundError, match=r"export.model_dir '.*nothing' holds no config.json"):
        export_hf(root, tmp_path / "hf", model_dir=str(tmp_path / "nothing"))
    assert not (tmp_path / "hf").exists()


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 2)
        self.register_buffer("seen", torch.arange(4, dtype=torch.int64))


def test_integer_tensors_keep_their_dtype_and_do_not_set_the_weights_dtype(tmp_path):
    model = Counter()
    save(SaveTarget(tmp_path / "ckpt", model_components(model), config={"model": {"width": 3}}), STATE)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype=torch.float16)
    weights = load_file(out / SAFE_WEIGHTS)
    assert weights["seen"].dtype == torch.int64 and torch.equal(weights["seen"], torch.arange(4))
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float16" and config["fntrain_model"] == {"width": 3}
    assert config["num_parameters"] == 3 * 2 + 2 + 4


def test_bad_sources_and_outputs_name_themselves(tmp_path):
    model = Counter()
    save(SaveTarget(tmp_path / "run" / "checkpoints", model_components(model)), STATE)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=r"output '.*file' exists and is not a directory"):
        export_hf(tmp_path / "run" / "checkpoints", tmp_path / "file")
    with pytest.raises(FileNotFoundError, match=r"checkpoint '.*file' is a file, not a directory"):
        export_hf(tmp_path / "file", tmp_path / "out")
    with pytest.raises(
        FileNotFoundError, match=r"is a run directory; export one of its checkpoints: .*checkpoints"
    ):
        export_hf(tmp_path / "run", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"'.*empty' is not a complete checkpoint"):
        export_hf(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"'.*empty' holds no \*.safetensors files"):
        import_hf(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_no_output_and_no_staging(tmp_path, monkeypatch):
    save(SaveTarget(tmp_path / "ckpt", model_components(Counter())), STATE)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("kept")

    def broken(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "_write_config", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no .hf.tmp-* left
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["old.txt"]  # the old output is whole


def _write_raw_safetensors(file: Path, tensors: dict[str, tuple[str, list[int], bytes]], pad: int) -> None:
    """A safetensors file written by hand, its header padded with `pad` spaces (0: unaligned data)."""
    header, offset, data = {}, 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    text = json.dumps(header).encode() + b" " * pad
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_hand_written_safetensors_are_read_or_refused(tmp_path):
    values = torch.tensor([1.5, -2.0, 3.25])
    source = tmp_path / "src"
    source.mkdir()
    text_length = len(json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}))
    pad = next(p for p in range(1, 4) if (8 + text_length + p) % 4)  # data starts off a 4-byte boundary
    _write_raw_safetensors(source / "a.safetensors", {"w": ("F32", [3], values.numpy().tobytes())}, pad)
    (source / PROVENANCE).write_text(json.dumps({"format": hf_export.PROVENANCE_FORMAT, "step": 4}))
    back = import_hf(source, tmp_path / "dcp")
    assert back.name == "step_4" and torch.equal(dcp_model_tensors(back)["model.w"], values)

    (source / PROVENANCE).write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match=r"fntrain_export.json has format 99; this fntrain reads 1"):
        import_hf(source, tmp_path / "x")
    (source / PROVENANCE).unlink()
    save_file({"w": values}, str(source / "b.safetensors"))
    with pytest.raises(ValueError, match=r"tensor w appears in more than one file of"):
        import_hf(source, tmp_path / "x")
    for file in source.iterdir():
        file.unlink()
    _write_raw_safetensors(source / "c.safetensors", {"z": ("C64", [1], b"\0" * 8)}, 8)
    with pytest.raises(
        ValueError, match=r"c.safetensors: tensor z has dtype C64, which fntrain does not read"
    ):
        import_hf(source, tmp_path / "x")
    assert not (tmp_path / "x").exists()
