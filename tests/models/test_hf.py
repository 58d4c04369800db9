"""Hugging Face model glue (fntrain.models.hf): local directories only (clear errors, never a download),
the offline switches, and a tiny Llama + a BPE tokenizer trained here: loaded with `load_causal_lm`
(plain and meta-init), saved with `save_hf_model`, reloaded by transformers with equal logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fntrain.checkpoint import hf_export
from fntrain.config import ConfigError
from fntrain.models.hf import (
    OFFLINE_SWITCHES,
    ModelAssets,
    causal_lm_from_config,
    check_vocab,
    dtype_kwargs,
    load_assets,
    load_causal_lm,
    load_pretrained,
    save_hf_model,
    set_offline,
    unwrap,
)
from fntrain.models.hf_config import AssetsConfig, HFModelConfig, check_packed_attention, require_local_dir
from fntrain.runtime import Runtime
from fntrain.runtime.parallel import ParallelConfig
from tests.helpers.hf import TEMPLATE, save_tiny_llama

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CORPUS = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep;",
    "No more; and by a sleep to say we end",
] * 4


@pytest.fixture(scope="module")
def tiny_hf_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama and a byte-level BPE tokenizer (with a chat template) in save_pretrained layout."""
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "model", CORPUS, vocab_size=300, max_positions=64)


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])


# ----------------------------------------------------------------------------- local directories only


def test_local_dir_checks_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="model.path 'meta-llama/Llama-3-8B' is not a local directory"):
        require_local_dir("model.path", "meta-llama/Llama-3-8B")
    assert require_local_dir("x.dir", str(tmp_path)) == tmp_path
    with pytest.raises(ConfigError, match=r"x.dir '.*' lacks config.json, tokenizer.json"):
        require_local_dir("x.dir", str(tmp_path), needs=("config.json", "tokenizer.json"))


def test_model_config_validate_checks_the_directory(tmp_path):
    with pytest.raises(ValueError, match="model.path is required: a local model directory"):
        HFModelConfig().validate()
    with pytest.raises(ConfigError, match="student.path 'org/name' is not a local directory"):
        HFModelConfig(path="org/name").validate("student")
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(ConfigError, match="model.path '.*' lacks config.json"):
        HFModelConfig(path=str(model_dir)).validate()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"model.path '.*' holds no \*.safetensors weights"):
        HFModelConfig(path=str(model_dir)).validate()
    (model_dir / "model.safetensors.index.json").write_text("{}")
    HFModelConfig(path=str(model_dir)).validate()
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        HFModelConfig(path=str(model_dir), dtype="int8").validate()
    with pytest.raises(ValueError, match="model.attn_implementation must be one of"):
        HFModelConfig(path=str(model_dir), attn_implementation="flex").validate()


def test_assets_config_validate(tmp_path):
    AssetsConfig().validate()
    AssetsConfig(tokenizer_path=str(tmp_path), chat_template="{{ messages }}").validate()
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    AssetsConfig(chat_template=str(tmp_path / "template.jinja")).validate()
    with pytest.raises(ConfigError, match="assets.tokenizer_path 'nope/tok' is not a local directory"):
        AssetsConfig(tokenizer_path="nope/tok").validate()
    with pytest.raises(ConfigError, match="assets.chat_template 'missing.jinja' is neither a file"):
        AssetsConfig(chat_template="missing.jinja").validate()


def test_loading_sets_the_offline_switches_and_never_looks_up_a_hub_id(monkeypatch):
    for name in OFFLINE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="model.path 'meta-llama/Llama-3-8B' is not a local directory"):
        load_pretrained(HFModelConfig(path="meta-llama/Llama-3-8B"), "cpu")
    assert all(os.environ[name] == "1" for name in OFFLINE_SWITCHES)
    for name in OFFLINE_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    set_offline()
    assert {name: os.environ[name] for name in OFFLINE_SWITCHES} == OFFLINE_SWITCHES
    assert hf_export.set_offline is set_offline  # the export shares the switches, no copy of its own


def test_dtype_kwargs_name_the_installed_transformers_keyword():
    import transformers

    assert dtype_kwargs(None) == {}
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    expected = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    assert dtype_kwargs(torch.bfloat16) == {expected: torch.bfloat16}


# ----------------------------------------------------------------------------- a real tiny Llama


def test_load_assets_reads_the_local_tokenizer(tiny_hf_model_dir, tmp_path):
    assets = load_assets(HFModelConfig(path=str(tiny_hf_model_dir)), AssetsConfig())
    tokenizer = assets.tokenizer
    assert (assets.pad_id, assets.eos_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert assets.chat_template == TEMPLATE and tokenizer.is_fast
    other = load_assets(
        HFModelConfig(path="unused"),
        AssetsConfig(tokenizer_path=str(tiny_hf_model_dir), chat_template="{{ x }}"),
    )
    assert other.chat_template == "{{ x }}" == other.tokenizer.chat_template
    with pytest.raises(ConfigError, match="assets.tokenizer_path"):
        load_assets(
            HFModelConfig(path=str(tiny_hf_model_dir)), AssetsConfig(tokenizer_path=str(tmp_path / "no"))
        )


def _model_dir_without(tiny_model_dir, tmp_path, *patterns):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy, ignore=shutil.ignore_patterns(*patterns))
    return copy


def test_a_model_dir_without_a_tokenizer_names_the_dir(tiny_hf_model_dir, tmp_path):
    bare = _model_dir_without(tiny_hf_model_dir, tmp_path, "tokenizer*", "special_tokens*")
    HFModelConfig(path=str(bare)).validate()  # a model directory all the same
    with pytest.raises(ConfigError, match=rf"model.path '{bare}' holds no tokenizer \(none of tokenizer.json, .*\): "
                                          r"save one there with tokenizer.save_pretrained \(or set assets.tokenizer_path\)"):  # fmt: skip
        load_assets(HFModelConfig(path=str(bare)), AssetsConfig())
    (bare / "tokenizer_config.json").write_text("{}")  # a tokenizer transformers cannot build
    with pytest.raises(ConfigError, match=rf"model.path '{bare}': its tokenizer cannot be loaded \(.+\)$"):
        load_assets(HFModelConfig(path=str(bare)), AssetsConfig())


@pytest.mark.parametrize(
    "config_json, message",
    [
        ("{not json", r"config.json is not a JSON file"),
        ("[1, 2]", r"config.json must hold a JSON object"),
        ('{"model_type": "no_such_architecture"}', r"config.json is not a model config transformers reads \(.*no_such_architecture"),
        ('{"model_type": "clip"}', r"is not a causal LM \(model_type 'clip'\): the hf_causal_lm recipe needs"),
    ],
)  # fmt: skip
def test_a_model_dir_that_transformers_cannot_build_names_the_dir(
    tiny_hf_model_dir, tmp_path, config_json, message
):
    """Found from config.json alone (what the run's first phase builds on the meta device), before
    any weight is read; each error one line."""
    model_dir = _model_dir_without(tiny_hf_model_dir, tmp_path)
    (model_dir / "config.json").write_text(config_json)
    with pytest.raises(ConfigError, match=rf"model.path '{model_dir}'.*{message}") as caught:
        HFModelConfig(path=str(model_dir)).validate()
        causal_lm_from_config(HFModelConfig(path=str(model_dir)))
    assert "\n" not in str(caught.value)


def test_a_model_path_that_is_a_file_says_so(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model.path '.*model.safetensors' is a file, not a directory"):
        HFModelConfig(path=str(tmp_path / "model.safetensors")).validate()


@pytest.mark.parametrize("meta_init", [False, True])
def test_load_causal_lm_then_save_reloads_with_equal_logits(tiny_hf_model_dir, tmp_path, meta_init):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = HFModelConfig(path=str(tiny_hf_model_dir))
    runtime = Runtime()
    model = load_causal_lm(config, runtime, ParallelConfig(meta_init=meta_init))
    assert unwrap(model) is model and next(model.parameters()).device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf_model_dir, local_files_only=True)
    torch.testing.assert_close(logits_of(model, IDS), logits_of(reference, IDS), atol=0, rtol=0)

    assets = check_vocab(config, load_assets(config, AssetsConfig()))
    out = save_hf_model(model, assets, tmp_path / "out", runtime)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    torch.testing.assert_close(logits_of(reloaded, IDS), logits_of(model, IDS), atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template == TEMPLATE


def test_bfloat16_dtype_is_passed_to_transformers(tiny_hf_model_dir):
    model = load_pretrained(HFModelConfig(path=str(tiny_hf_model_dir), dtype="bfloat16"), "cpu")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_check_vocab_reads_the_models_vocabulary_without_loading_it(tiny_hf_model_dir):
    config = HFModelConfig(path=str(tiny_hf_model_dir))
    rows = load_pretrained(config, "cpu").get_input_embeddings().weight.shape[0]
    fits = ModelAssets(tokenizer=[0] * rows, pad_id=0, eos_id=None, chat_template=None)
    assert check_vocab(config, fits) is fits
    too_many = ModelAssets(tokenizer=[0] * (rows + 1), pad_id=0, eos_id=None, chat_template=None)
    with pytest.raises(
        ValueError, match=f"the tokenizer has {rows + 1} tokens but .* vocabulary only {rows}"
    ):
        check_vocab(config, too_many)


def test_packing_needs_the_sdpa_kernel():
    check_packed_attention(HFModelConfig(path="m"), packing=True)
    check_packed_attention(HFModelConfig(path="m", attn_implementation="eager"), packing=False)
    with pytest.raises(ValueError, match="model.attn_implementation 'eager' cannot take packed data"):
        check_packed_attention(HFModelConfig(path="m", attn_implementation="eager"), packing=True)


def test_loading_draws_no_progress_bar_into_a_log_and_restores_the_setting(tiny_hf_model_dir, capsys, monkeypatch):
    """[issue 27] transformers' "Loading weights" bar in a non-terminal log: off while fntrain loads
    (stderr here is pytest's capture, not a terminal), the process's setting back afterwards; on a
    terminal it is left alone."""
    from transformers.utils import logging as hf_logging

    from fntrain.models import hf as hf_module
    from fntrain.models.hf import load_pretrained, quiet_progress_bars

    hf_logging.enable_progress_bar()
    load_pretrained(HFModelConfig(path=str(tiny_hf_model_dir)), "cpu")
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # scoped: not turned off for the rest of the process
    monkeypatch.setattr(hf_module, "_stderr_is_terminal", lambda: True)
    with quiet_progress_bars():
        assert hf_logging.is_progress_bar_enabled()
    monkeypatch.setattr(hf_module, "_stderr_is_terminal", lambda: False)
    with quiet_progress_bars():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
