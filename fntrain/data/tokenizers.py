"""Tokenizers for `fntrain tokenize`: a text -> ids function with its EOS id and what the index records.

A tokenizer is anything that turns text into ids: `byte_tokenizer()` (UTF-8 bytes, EOS 256),
`hf_tokenizer(path_or_object)` (a local Hugging Face tokenizer; never downloads), or any callable
`text -> ids` wrapped by `as_tokenizer(fn, eos_id=...)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fntrain.config import require_int

__all__ = ["Tokenizer", "byte_tokenizer", "hf_tokenizer", "as_tokenizer"]


@dataclass(frozen=True)
class Tokenizer:
    """A text -> ids function, its EOS id, and what the shard index records about it.

    encode_batch, when given, tokenizes a list of texts at once (Hugging Face fast tokenizers do that
    in parallel); it must give the same ids as `encode` on each text.
    """

    encode: Callable[[str], Sequence[int]]
    eos_id: int
    vocab_size: int | None = None
    name: str = "custom"
    encode_batch: Callable[[list[str]], Sequence[Sequence[int]]] | None = None


def byte_tokenizer(eos_id: int = 256) -> Tokenizer:
    """UTF-8 bytes as ids 0..255; EOS defaults to 256 (vocabulary 257). eos_id 0 keeps a 256-id vocabulary
    (NUL rarely occurs in text) for byte models such as recipes/tiny_gpt.py."""
    require_int("eos_id", eos_id, min=0)

    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    return Tokenizer(encode, eos_id, vocab_size=max(256, eos_id + 1), name="bytes")


def hf_tokenizer(source: Any, *, eos_id: int | None = None) -> Tokenizer:
    """A Hugging Face tokenizer: a local directory (loaded with `local_files_only`) or a tokenizer object.

    Texts are encoded without special tokens (EOS is appended by the shard writer); eos_id defaults to
    the tokenizer's `eos_token_id`."""
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoTokenizer

        path = Path(source).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer {str(source)!r} is not a local directory (nothing is downloaded)"
            )
        source = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tokenizer = source
    eos = tokenizer.eos_token_id if eos_id is None else eos_id
    if eos is None:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no EOS token; pass eos_id"
        )

    def encode(text: str) -> Sequence[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_batch(texts: list[str]) -> Sequence[Sequence[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    return Tokenizer(
        encode,
        int(eos),
        vocab_size=len(tokenizer),
        name=str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        encode_batch=encode_batch,
    )


def as_tokenizer(tokenizer: Any, *, eos_id: int | None = None, vocab_size: int | None = None) -> Tokenizer:
    """A `Tokenizer` from: a `Tokenizer`; "bytes"; a local Hugging Face tokenizer directory; a Hugging Face
    tokenizer object; or any callable `text -> ids` (then eos_id is required). eos_id / vocab_size given
    here override the tokenizer's own."""
    if isinstance(tokenizer, Tokenizer):
        built = tokenizer
    elif isinstance(tokenizer, str) and tokenizer == "bytes":
        built = byte_tokenizer() if eos_id is None else byte_tokenizer(eos_id)
    elif isinstance(tokenizer, (str, os.PathLike)) or hasattr(tokenizer, "eos_token_id"):
        built = hf_tokenizer(tokenizer, eos_id=eos_id)
    elif callable(tokenizer):
        if eos_id is None:
            raise ValueError("a tokenizer given as a plain callable needs eos_id")
        built = Tokenizer(
            tokenizer, eos_id, vocab_size=vocab_size, name=getattr(tokenizer, "__name__", "custom")
        )
    else:
        raise TypeError(
            f"tokenizer must be a Tokenizer, 'bytes', a path, an HF tokenizer or a callable, got {tokenizer!r}"
        )
    if eos_id is not None and built.eos_id != eos_id:
        built = replace(built, eos_id=eos_id)
    if vocab_size is not None:
        built = replace(built, vocab_size=vocab_size)
    require_int("eos_id", built.eos_id, min=0)
    if built.vocab_size is not None and built.eos_id >= built.vocab_size:
        raise ValueError(f"eos_id {built.eos_id} is outside the vocabulary of {built.vocab_size} ids")
    return built
