"""transformers' "Writing model shards" bar stays out of a log (stderr not a terminal) when fntrain saves
a model, and the process's own setting is back afterwards."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # builds a transformers model


def test_saving_a_model_draws_no_bar_into_a_log(tmp_path, capsys):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from fntrain.models.hf import ModelAssets, save_hf_model
    from fntrain.runtime import Runtime

    class Tokenizer:
        def save_pretrained(self, directory: str) -> None:
            pass

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    hf_logging.enable_progress_bar()
    model.save_pretrained(str(tmp_path / "plain"))
    assert "Writing model shards" in capsys.readouterr().err  # the bar this test keeps out
    save_hf_model(model, ModelAssets(Tokenizer(), 0, None, None), tmp_path / "saved", Runtime())
    assert "Writing model shards" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled() and (tmp_path / "saved" / "config.json").is_file()
