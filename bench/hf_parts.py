"""What the benchmarks against Hugging Face trainers share: a random Llama built from a config and a
word-level tokenizer built in memory (nothing is downloaded), so both sides start from the same weights
and the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["llama", "word_tokenizer", "words"]


def llama(shape: Mapping[str, int], *, seed: int = 0, **config: Any) -> torch.nn.Module:
    """A `LlamaForCausalLM` of `shape` (LlamaConfig fields) with weights drawn under `seed`; `config`
    adds further LlamaConfig fields (token ids, attention implementation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**shape, **config))


def word_tokenizer(words_in_vocab: int, *, eos_id: int | None) -> Any:
    """Words t1 .. t{words_in_vocab - 1} as ids 1 .. words_in_vocab - 1, <pad> as 0 and, unless `eos_id`
    is None, <eos> as `eos_id` (a new id past the words, or one of them renamed): split on whitespace,
    no special tokens added, so a text of n words is n ids on every side."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, words_in_vocab)}}
    if eos_id is not None:
        vocab = {word: index for word, index in vocab.items() if index != eos_id} | {"<eos>": eos_id}
    table = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    table.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"eos_token": "<eos>"} if eos_id is not None else {}
    return PreTrainedTokenizerFast(tokenizer_object=table, pad_token="<pad>", **special)


def words(ids: Any) -> str:
    """The text `word_tokenizer` reads back as `ids` (ids of its words, not the pad or the EOS)."""
    return " ".join(f"t{token}" for token in ids)
