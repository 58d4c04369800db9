"""The tokenizer files an export carries (fntrain/models/tokenizer_files.py): the byte tokenizer, written
without transformers, loads in transformers and maps each UTF-8 byte to its id and back; a tiny GPT over
token shards gets the shards' EOS or the tokenizer directory they were written with, and none when that
directory is gone."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from fntrain.data.tokenize import tokenize_files
from fntrain.models.tokenizer_files import has_tokenizer, text_tokenizer, write_byte_tokenizer

TEXT = "To be, or not to be . é ñ 漢字\n\t end"


def auto_tokenizer(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@pytest.mark.parametrize("eos_id", [None, 256])
def test_the_byte_tokenizer_maps_each_byte_to_its_id_and_back(tmp_path, eos_id):
    write_byte_tokenizer(tmp_path, eos_id)
    tokenizer = auto_tokenizer(tmp_path)
    assert tokenizer(TEXT)["input_ids"] == list(TEXT.encode("utf-8"))  # no BOS, no EOS added, no merges
    assert tokenizer.decode([*TEXT.encode("utf-8"), *([eos_id] if eos_id else [])], skip_special_tokens=True) == TEXT
    assert tokenizer.decode([0xC3]) == "\ufffd"  # half a character
    # lm-eval needs an end-of-text and a pad token: the data's EOS, else byte 0 (NUL, absent from text)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (eos_id if eos_id else 0, 0)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class transformers 4 knows too
    assert config["clean_up_tokenization_spaces"] is False  # transformers 4 would turn "be ." into "be."


def test_writing_the_byte_tokenizer_needs_neither_transformers_nor_tokenizers(tmp_path, monkeypatch):
    for name in ("transformers", "tokenizers"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of either fails
    write_byte_tokenizer(tmp_path, None)
    assert has_tokenizer(tmp_path) and not has_tokenizer(tmp_path / "nowhere")


def test_a_model_over_token_shards_gets_their_eos_or_their_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be\n")
    tokenize_files([corpus], tmp_path / "bytes")  # "bytes": the EOS is 256
    text_tokenizer(str(tmp_path / "bytes"))(tmp_path / "from_bytes")
    assert auto_tokenizer(tmp_path / "from_bytes").eos_token_id == 256
    text_tokenizer(None)(tmp_path / "plain")  # a text file: bytes without an EOS
    assert auto_tokenizer(tmp_path / "plain").eos_token_id == 0

    write_byte_tokenizer(tmp_path / "tokenizer", 256)  # any Hugging Face tokenizer directory
    (tmp_path / "tokenizer" / "special_tokens_map.json").write_text("{}")
    (tmp_path / "tokenizer" / "model.safetensors").write_text("not a tokenizer file")
    tokenize_files([corpus], tmp_path / "hf", str(tmp_path / "tokenizer"))
    text_tokenizer(str(tmp_path / "hf"))(tmp_path / "copied")
    assert sorted(p.name for p in (tmp_path / "copied").iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    shutil.rmtree(tmp_path / "tokenizer")
    assert text_tokenizer(str(tmp_path / "hf")) is None  # the shards' tokenizer is gone: nothing to write
    assert text_tokenizer(str(tmp_path / "no_shards")) is None
