"""A tiny Llama to try the Hugging Face recipes with, made here (nothing is downloaded): a randomly
initialised `LlamaForCausalLM` of `TinyLlamaConfig`'s shape and a byte-level BPE tokenizer trained on the
bundled Shakespeare corpus, with a chat template, in `save_pretrained` layout (`fntrain tiny-llama DIR`).

    write_tiny_llama("my-llama", TinyLlamaConfig())     # -> my-llama/{config.json, model.safetensors, ...}

A pure function of the config: the same config writes the same files (the weights come from a generator
seeded by `seed`, the tokenizer from a fixed slice of the corpus). The directory appears whole or not at
all (`staged_out`: written beside it, then renamed); an existing non-empty one is refused.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fntrain.checkpoint.hf_load import set_offline
from fntrain.checkpoint.staged_out import check_out, staged_out
from fntrain.config import require_int

__all__ = ["CHAT_TEMPLATE", "TinyLlamaConfig", "build_tiny_llama", "write_tiny_llama"]

# The chat template the tokenizer carries: roles as `<|role|>` lines, each turn closed by EOS (so a
# fine-tuned model learns to stop), `add_generation_prompt` opening the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# The tokenizer learns its merges from the corpus's first 300,000 characters: enough text for a few
# thousand merges, and about a second of training (the whole 2.2 MB corpus takes several).
TOKENIZER_TEXT_CHARS = 300_000


@dataclass(frozen=True)
class TinyLlamaConfig:
    """The tiny Llama's shape: `layers` decoder layers of width `hidden_size` (MLP 4x wider), `heads`
    attention heads sharing `kv_heads` key/value heads, a BPE vocabulary of `vocab_size` tokens (the 256
    bytes, 4 special tokens and merges), rotary positions up to `max_positions`, weights from `seed`."""

    layers: int = 2
    """decoder layers"""
    hidden_size: int = 64
    """model width (the MLP is 4x wider); hidden_size / heads must be even (rotary positions)"""
    heads: int = 4
    """attention heads"""
    kv_heads: int = 2
    """key/value heads (grouped-query attention); divides heads"""
    vocab_size: int = 1024
    """BPE vocabulary: the 256 bytes, 4 special tokens (<unk> <s> </s> <pad>) and merges"""
    max_positions: int = 2048
    """the longest sequence the model takes (max_position_embeddings)"""
    seed: int = 0
    """seed of the random initial weights"""

    def validate(self, prefix: str = "") -> None:
        """Each field a positive int (seed >= 0, vocab_size in [300, 65536]); hidden_size a multiple of
        2 x heads, heads a multiple of kv_heads. Errors name the field as `prefix` + its name."""
        for name, value in asdict(self).items():
            if name == "vocab_size":
                require_int(f"{prefix}{name}", value, min=300, max=65536)
            else:
                require_int(f"{prefix}{name}", value, min=0 if name == "seed" else 1)
        if self.hidden_size % (2 * self.heads):  # rotary embeddings rotate pairs of each head's dims
            raise ValueError(f"{prefix}hidden_size ({self.hidden_size}) must be a multiple of 2 x "
                             f"{prefix}heads ({2 * self.heads}): each head's width must be even")  # fmt: skip
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{prefix}heads ({self.heads}) must be a multiple of {prefix}kv_heads ({self.kv_heads})"
            )


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (every string encodes, no unknown token in practice) trained on the
    bundled corpus, adding BOS before every encoded text, with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from fntrain.data.corpora import corpus_path

    text = corpus_path("shakespeare").read_text(encoding="utf-8")[:TOKENIZER_TEXT_CHARS]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    bpe.train_from_iterator(text.splitlines(), trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_llama(tiny: TinyLlamaConfig) -> tuple[Any, Any]:
    """(model, tokenizer): the tokenizer trained, the model of `tiny`'s shape over its vocabulary,
    initialised from `tiny.seed` (the process's global RNG left as it was)."""
    set_offline()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny.validate()
    tokenizer = _train_tokenizer(tiny.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, intermediate_size=4 * tiny.hidden_size,
        num_hidden_layers=tiny.layers, num_attention_heads=tiny.heads, num_key_value_heads=tiny.kv_heads,
        max_position_embeddings=tiny.max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def write_tiny_llama(directory: str | os.PathLike, tiny: TinyLlamaConfig) -> Path:
    """Write the tiny Llama of `tiny` (model and tokenizer, `save_pretrained` layout) to `directory`,
    atomically; returns it. A `directory` that is a file or a non-empty directory is refused
    (`FileExistsError`) before anything is built; a bad `tiny` is a `ValueError`/`TypeError`."""
    from fntrain.models.hf import quiet_progress_bars

    out = Path(directory).expanduser()
    tiny.validate()
    if out.is_symlink() or (out.exists() and not (out.is_dir() and not any(out.iterdir()))):
        raise FileExistsError(f"{str(directory)!r} exists and is not an empty directory: name a new one")
    check_out(out, overwrite=False)  # a parent that is a file
    model, tokenizer = build_tiny_llama(tiny)
    with staged_out(out, overwrite=False) as staging, quiet_progress_bars():
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
    return out
