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


def save_tokenizer_kinds(root: Path, tokenizer, *, vocab_size: int, max_positions: int) -> dict[str, dict]:
    """The fast `tokenizer` (a byte-level BPE with BOS and a chat template, as tests/data/test_preference.py's
    `tiny_tokenizer` builds) saved under `root` in each way a user can bring one, as the keywords of
    the `model` and `assets` settings that load it: tokenizer.json with the template in
    chat_template.jinja (what save_pretrained writes) or in tokenizer_config.json, the template given by
    `--assets.chat-template` as a file or as text, only vocab.json + merges.txt (GPT2Tokenizer), and
    the tokenizer in the model's own directory. Each model directory holds only a config.json."""
    import json

    from transformers import GPT2Config

    def model_dir(name: str) -> str:
        shape = dict(vocab_size=vocab_size, n_positions=max_positions, bos_token_id=None, eos_token_id=None)
        GPT2Config(**shape).save_pretrained(root / name)
        return str(root / name)

    def saved(name: str, *, template: bool = True) -> Path:
        tokenizer.save_pretrained(root / name)
        if not template:
            (root / name / "chat_template.jinja").unlink()
        return root / name

    template = saved("jinja").joinpath("chat_template.jinja").read_text()
    in_config = saved("in-config", template=False)
    config = json.loads((in_config / "tokenizer_config.json").read_text())
    (in_config / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (root / "template.jinja").write_text(template)
    files = root / "vocab-merges"
    files.mkdir()
    tokenizer.backend_tokenizer.model.save(str(files))  # vocab.json and merges.txt, nothing else
    special = {f"{name}_token": getattr(tokenizer, f"{name}_token") for name in ("bos", "eos", "pad", "unk")}
    (files / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True,
                                                             **special}))  # fmt: skip
    (files / "chat_template.jinja").write_text(template)
    model = model_dir("model")
    no_template = str(saved("no-template", template=False))
    tokenizer.save_pretrained(root / "model-with-tokenizer")
    return {
        "tokenizer.json + chat_template.jinja": dict(model=model, tokenizer_path=str(root / "jinja")),
        "template in tokenizer_config.json": dict(model=model, tokenizer_path=str(in_config)),
        "--assets.chat-template FILE": dict(
            model=model, tokenizer_path=no_template, chat_template=str(root / "template.jinja")
        ),
        "--assets.chat-template TEXT": dict(model=model, tokenizer_path=no_template, chat_template=template),
        "vocab.json + merges.txt": dict(model=model, tokenizer_path=str(files)),
        "in model.path": dict(model=model_dir("model-with-tokenizer")),
    }


def save_byte_tokenizer_pair(root: Path, chat_template: str, *, max_positions: int) -> dict[str, dict]:
    """One byte vocabulary (ids: <pad> 0, </s> 1, <unk> 2, byte b as b + 3; </s> appended to a text) in
    two kinds, with `chat_template`, as the keywords of the `model` and `assets` settings that load
    them: transformers' ByT5Tokenizer (slow: no offsets, `is_fast` False) and a fast tokenizer.json
    built here to give the same ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import ByT5Tokenizer, GPT2Config, PreTrainedTokenizerFast

    from fntrain.models.tokenizer_files import _bytes_to_unicode

    alphabet = _bytes_to_unicode()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{alphabet[byte]: byte + 3 for byte in range(256)}}
    bytes_bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    bytes_bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bytes_bpe.decoder = decoders.ByteLevel()
    bytes_bpe.add_special_tokens(
        [AddedToken(token, lstrip=True, rstrip=True) for token in ("<pad>", "</s>", "<unk>")]
    )
    bytes_bpe.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bytes_bpe, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    slow = ByT5Tokenizer(extra_ids=0)
    for name, tokenizer in (("byt5", slow), ("bytes-fast", fast)):
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(root / name)
    GPT2Config(
        vocab_size=len(vocab), n_positions=max_positions, bos_token_id=None, eos_token_id=None
    ).save_pretrained(root / "model")
    model = str(root / "model")
    return {
        "ByT5Tokenizer (slow)": dict(model=model, tokenizer_path=str(root / "byt5")),
        "tokenizer.json (fast)": dict(model=model, tokenizer_path=str(root / "bytes-fast")),
    }
