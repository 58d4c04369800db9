"""`fntrain tiny-llama DIR`: a tiny local Llama and its tokenizer, made here, that the Hugging Face stack
loads; seeded (the same options write the same files); written whole or not at all; bad input is one
line and exit status 2 before anything is built."""

from __future__ import annotations

import importlib.util

import pytest

from fntrain.cli import dispatch
from fntrain.models.tiny_llama import TinyLlamaConfig

pytest.importorskip("transformers")


def _fail(capsys, argv) -> str:
    with pytest.raises(SystemExit) as caught:
        dispatch(argv)
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.slow  # loads transformers' Llama and trains a tokenizer: ~5-10 s on 2 shared cores
def test_the_directory_loads_chats_and_is_the_same_twice(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first, second = tmp_path / "my-llama", tmp_path / "again"
    assert dispatch(["tiny-llama", str(first), "--vocab-size", "400"]) == first
    assert "a tiny Llama (2 layers, width 64)" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(first, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(first, local_files_only=True)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer) == 400
    assert model.config.max_position_embeddings == 2048
    chat = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A king."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == "<s><|user|>\nWho art thou?</s>\n<|assistant|>\nA king.</s>\n"
    prompt = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")
    ids = tokenizer("ROMEO: what light")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids[1:]) == "ROMEO: what light"
    assert model(input_ids=__import__("torch").tensor([ids])).logits.shape == (1, len(ids), 400)
    dispatch(["tiny-llama", str(second), "--vocab-size", "400"])
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging left


def test_bad_input_is_one_line_before_anything_is_built(tmp_path, capsys, monkeypatch):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert _fail(capsys, ["tiny-llama", str(occupied)]) == (
        f"fntrain tiny-llama: {str(occupied)!r} exists and is not an empty directory: name a new one"
    )
    assert [path.name for path in occupied.iterdir()] == ["notes.txt"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "exists and is not an empty directory" in _fail(capsys, ["tiny-llama", str(a_file)])
    out = tmp_path / "new"
    assert "--hidden-size (60) must be a multiple of 2 x --heads (8)" in _fail(
        capsys, ["tiny-llama", str(out), "--hidden-size", "60"]
    )
    assert "--heads (4) must be a multiple of --kv-heads (3)" in _fail(
        capsys, ["tiny-llama", str(out), "--kv-heads", "3"]
    )
    assert _fail(capsys, ["tiny-llama", str(out), "--vocab-size", "10"]).endswith(
        "--vocab-size must be >= 300, got 10"
    )
    assert "--layers" in _fail(capsys, ["tiny-llama", str(out), "--layers", "two"])
    assert "DIR" in _fail(capsys, ["tiny-llama"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))  # fmt: skip
    assert _fail(capsys, ["tiny-llama", str(out)]) == (
        "fntrain tiny-llama: needs transformers and tokenizers (the hf extra): pip install 'fntrain[hf]'"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "occupied"]


def test_help_says_what_it_is_for(capsys):
    with pytest.raises(SystemExit) as caught:
        dispatch(["tiny-llama", "--help"])
    out = capsys.readouterr().out
    assert caught.value.code == 0
    assert "to try the HF recipes with" in out and "--vocab-size" in out and "--layers" in out
    dispatch(["--help"])
    assert "fntrain tiny-llama DIR" in capsys.readouterr().out


def test_the_config_names_its_fields():
    TinyLlamaConfig().validate()
    with pytest.raises(ValueError, match=r"^tiny\.seed must be >= 0, got -1"):
        TinyLlamaConfig(seed=-1).validate("tiny.")
    with pytest.raises(TypeError, match="layers must be an int"):
        TinyLlamaConfig(layers=True).validate()
