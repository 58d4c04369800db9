"""The tokenizer files that go with an exported model, so that transformers (`AutoTokenizer`), lm-eval
and `fntrain generate` read its text as the run did.

    write_byte_tokenizer(out, eos_id=None)       # UTF-8 bytes as ids: tokenizer.json + tokenizer_config.json
    write = text_tokenizer("shards")             # what a model trained on these token shards reads text with
    write(out)                                   # (None: the shards' tokenizer directory is gone)

The byte tokenizer is GPT-2's byte-to-character table under a BPE without merges, so every byte is one
token whose id is the byte's value. It is written as JSON, needing neither transformers nor tokenizers (a
tiny GPT run's export writes it), in the layout `save_pretrained` writes and transformers 4 and 5 load.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "has_tokenizer", "write_byte_tokenizer", "copy_tokenizer", "text_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_ALSO_COPIED = ("merges.txt", "vocab.txt", "chat_template.jinja")
_EOS = "<|endoftext|>"


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer transformers can load (one of `TOKENIZER_FILES`)."""
    return directory.is_dir() and any((directory / name).is_file() for name in TOKENIZER_FILES)


def write_byte_tokenizer(directory: Path, eos_id: int | None) -> None:
    """Save a tokenizer to `directory` that maps UTF-8 bytes to ids 0..255, as the tiny GPT reads text,
    in save_pretrained layout; its EOS is `eos_id` when the run's data has one (above 255), else byte 0.

    lm-eval needs an end-of-text token (the prefix of an empty context) and a pad token (else it adds one
    past the model's vocabulary): without the data's EOS, byte 0 (NUL, absent from text) is both."""
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[byte]: byte for byte in range(256)}
    special = {alphabet[0]: 0}
    eos = alphabet[0]
    if eos_id is not None and eos_id >= 256:
        eos = _EOS
        vocab[eos] = special[eos] = eos_id
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for content, token_id in sorted(special.items(), key=lambda item: item[1])
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # a name transformers 4 and 5 both know
        "eos_token": eos,
        "pad_token": alphabet[0],
        "clean_up_tokenization_spaces": False,  # transformers 4 would otherwise drop the space in "a ."
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,  # transformers' "no limit"
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2, ensure_ascii=False) + "\n",
                                              encoding="utf-8")  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")  # fmt: skip


def copy_tokenizer(source: Path, directory: Path) -> None:
    """Copy the tokenizer files of the directory `source` (tokenizer*, special_tokens*, vocab and merges
    files, a chat template) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in source.iterdir():
        if entry.is_file() and (entry.name.startswith(("tokenizer", "special_tokens"))
                                or entry.name in (*TOKENIZER_FILES, *_ALSO_COPIED)):  # fmt: skip
            shutil.copy2(entry, directory / entry.name)


def text_tokenizer(shards: str | None) -> Callable[[Path], None] | None:
    """What writes the tokenizer of a model trained on the token shards `shards` (None: UTF-8 bytes, as
    the tiny GPT reads a text file) into a directory: bytes (with the shards' EOS), or the files of the
    tokenizer directory the shards were written with; None when the shards or that directory cannot be
    read from here."""
    if not shards:
        return functools.partial(write_byte_tokenizer, eos_id=None)
    from fntrain.data.shard_index import read_index

    try:
        index = read_index(shards)
    except (OSError, ValueError):
        return None
    if index.tokenizer in (None, "bytes"):
        return functools.partial(write_byte_tokenizer, eos_id=index.eos_id)
    source = Path(str(index.tokenizer)).expanduser()
    return functools.partial(copy_tokenizer, source) if has_tokenizer(source) else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}
