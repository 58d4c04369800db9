"""Shared by the Hugging Face tests: a chat template, two chats, and a tiny Llama with a byte-level BPE
tokenizer trained here and saved in save_pretrained layout (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

TINY_LLAMA_SHAPE = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
"""LlamaConfig keywords of the smallest Llama the benchmark tests run their quick rounds on (bench/dpo.py,
bench/grpo.py): one layer, a byte-sized vocabulary."""

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A king."}],
    [
        {"role": "system", "content": "Speak as a bard."},
        {"role": "user", "content": "Hail!"},
        {"role": "assistant", "content": "Well met."},
        {"role": "user", "content": "Sing."},
        {"role": "assistant", "content": "La la."},
    ],
]


def save_tiny_llama(model_dir: Path, lines: Sequence[str], *, vocab_size: int, max_positions: int) -> Path:
    """A 2-layer Llama and a BPE tokenizer trained on `lines` (with TEMPLATE), saved to `model_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(lines, trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir
