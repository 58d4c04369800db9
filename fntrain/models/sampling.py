"""Sampling one sequence from a causal language model, token by token (nanoGPT's `sample.py` loop).

    settings = SampleSettings(max_new_tokens=200, temperature=0.8, top_k=40)
    for token in sample_tokens(model, torch.tensor(prompt_ids), settings, torch.Generator().manual_seed(1)):
        print(decode([token]), end="", flush=True)

`sample_tokens` streams the new token ids: greedy at temperature 0, otherwise softmax sampling of the
logits over the temperature, cut to the top k and to the nucleus of mass top_p. Draws come only from the
generator passed in (the global RNG is never touched), so the same seed gives the same tokens.

Written here, not taken from transformers' `generate`: the tiny GPT is not a transformers model and
transformers is an optional extra; the loop is a screen long. HF models are sampled with `generate`.

The context: a prompt longer than the model's context keeps its last `context` tokens (truncated from
the left; front ends warn). A model with a KV cache (`model.new_kv_cache()`, the tiny GPT) feeds one token
per step while the cache has room, so the cost is linear in the length; once the window is full the
learned positions cannot slide under cached keys (each key holds its position), so every further token
recomputes the last `context` tokens, exactly what a model without a cache does at every step: the
tokens are the same with and without the cache.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.config import require_float, require_int

__all__ = ["SampleSettings", "sample_tokens", "model_context", "pick_token"]


@dataclass(frozen=True)
class SampleSettings:
    """How to draw the new tokens of one sequence."""

    max_new_tokens: int = 256
    """Tokens to generate at most (fewer when eos_id comes first)."""
    temperature: float = 1.0
    """Softmax temperature (0: greedy, the most likely token every step)."""
    top_k: int | None = None
    """Draw only among the k most likely tokens (None or 0: no cut)."""
    top_p: float = 1.0
    """Nucleus sampling: draw among the most likely tokens holding this much probability, in (0, 1] (1: no cut)."""
    eos_id: int | None = None
    """Stop once this token is produced (it is yielded, then the stream ends); None: never stop early."""

    def validate(self, prefix: str = "sample") -> None:
        """Value rules naming `prefix.field`."""
        require_int(f"{prefix}.max_new_tokens", self.max_new_tokens, min=1)
        require_float(f"{prefix}.temperature", self.temperature, min=0.0)
        if self.top_k is not None:
            require_int(f"{prefix}.top_k", self.top_k, min=0)
        require_float(f"{prefix}.top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{prefix}.top_p must be in (0, 1], got {self.top_p}")
        if self.eos_id is not None:
            require_int(f"{prefix}.eos_id", self.eos_id, min=0)


def model_context(model: Any) -> int | None:
    """The most positions `model` attends over: the tiny GPT's `cfg.context`, an HF config's
    `max_position_embeddings` / `n_positions`; None when it names none (then nothing is truncated)."""
    for holder, names in ((getattr(model, "cfg", None), ("context",)),
                          (getattr(model, "config", None), ("max_position_embeddings", "n_positions"))):  # fmt: skip
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def pick_token(logits: torch.Tensor, settings: SampleSettings, generator: torch.Generator | None) -> int:
    """The next token from the last position's logits [vocab], by `settings`, drawing from `generator`."""
    if settings.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / settings.temperature
    if settings.top_k and settings.top_k < scores.numel():
        kth = torch.topk(scores, settings.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        # Drop a token once the more likely ones already hold top_p; the most likely always stays.
        drop = cumulative - torch.softmax(ordered, dim=-1) >= settings.top_p
        drop[0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if generator is not None:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def _eager() -> Any:
    """Compiled blocks (--parallel.compile) run eagerly while sampling: they would recompile for every
    length. Only a process that compiled has torch._dynamo loaded; importing it here just to say so would
    cost every other process about a second."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


@torch.no_grad()  # per call, not around the loop: a `with` spanning a `yield` would leak into the caller
def _logits(model: Any, ids: torch.Tensor, kv_cache: Any = None) -> torch.Tensor:
    """The last position's logits [vocab] for `ids` [seq] (a MoE or an HF output: its `.logits`)."""
    with _eager():
        output = model(ids[None], kv_cache=kv_cache) if kv_cache is not None else model(ids[None])
    return getattr(output, "logits", output)[0, -1]


def sample_tokens(
    model: Any, prompt_ids: torch.Tensor, settings: SampleSettings, generator: torch.Generator | None = None
) -> Iterator[int]:
    """Streams the new token ids of one sequence continuing `prompt_ids` (a 1-D LongTensor, at least one
    token, on the model's device), under no_grad; the model's train/eval mode is the caller's. Draws come
    from `generator` only (None: a fresh, nondeterministically seeded one; the global RNG is never used).
    A prompt longer than the model's context keeps its last `context` tokens."""
    settings.validate()
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt_ids.shape)}")
    if generator is None and settings.temperature > 0:
        generator = torch.Generator()
        generator.seed()
    context = model_context(model)
    window = prompt_ids[-context:] if context else prompt_ids
    kv_cache = model.new_kv_cache() if hasattr(model, "new_kv_cache") else None
    logits = _logits(model, window, kv_cache)
    for produced in range(settings.max_new_tokens):
        token = pick_token(logits, settings, generator)
        yield token
        if token == settings.eos_id or produced + 1 == settings.max_new_tokens:
            return
        step = torch.tensor([token], dtype=window.dtype, device=window.device)
        window = torch.cat([window, step])
        if context and window.numel() > context:
            window = window[-context:]
        if kv_cache is not None and kv_cache.length < kv_cache.context:
            logits = _logits(model, step, kv_cache)  # one token's forward over the cached ones
        else:
            logits = _logits(model, window)  # the window is full: recompute it (see the module doc)
