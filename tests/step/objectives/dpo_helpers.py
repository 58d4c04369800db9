"""Shared by the preference-tuning and distillation tests: a tiny Llama and a synthetic preference set
with a known preferred answer (the true colour of a thing over a wrong one)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from tests.helpers.hf import save_tiny_llama

CORPUS = Path(__file__).resolve().parents[3] / "fntrain" / "data" / "corpora" / "shakespeare.txt"
COLOURS = {
    "the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "the sun": "yellow",
    "an orange": "orange", "a plum": "purple", "milk": "white", "a lemon": "yellow", "a crow": "black",
    "a rose": "red", "the sea": "blue", "a leaf": "green", "ink": "black", "chalk": "white",
}  # fmt: skip
QUESTIONS = ("What colour is {}?", "Name the colour of {}.", "Tell me: what colour is {}?")


def tiny_llama(directory: Path, *, vocab_size: int = 320, max_positions: int = 256) -> Path:
    """A 2-layer Llama with a byte-level BPE tokenizer (tests.helpers.hf), trained on the bundled corpus."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:2000] + [" ".join(COLOURS.values())]
    return save_tiny_llama(directory, lines, vocab_size=vocab_size, max_positions=max_positions)


def preference_rows(count: int, *, seed: int, things: tuple[str, ...] | None = None) -> list[dict[str, str]]:
    """`count` plain-text rows {prompt, chosen, rejected}: chosen names the thing's colour, rejected another."""
    rng = random.Random(seed)
    names = list(things or COLOURS)
    colours = sorted(set(COLOURS.values()))
    rows = []
    for _ in range(count):
        thing = rng.choice(names)
        wrong = rng.choice([colour for colour in colours if colour != COLOURS[thing]])
        prompt = rng.choice(QUESTIONS).format(thing)
        rows.append({"prompt": prompt, "chosen": f" It is {COLOURS[thing]}.", "rejected": f" It is {wrong}."})
    return rows


def bigger_teacher(student: Path, teacher: Path) -> Path:
    """The student's directory with a wider, deeper Llama in place of its model: the same tokenizer files
    (so the same vocabulary, token for token), 3 layers of width 64 against the student's 2 of 32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.copytree(student, teacher)
    config = LlamaConfig.from_pretrained(teacher)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 64, 128, 3
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(teacher)
    return teacher
