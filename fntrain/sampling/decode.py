"""Decoding a batch of prompts, one generator per row: the loop `fntrain generate`, the samples hook and
the GRPO rollout share.

    generators = [row_generator(seed, index) for index in range(len(prompts))]
    decoded = decode(model, prompts, SampleSettings(max_new_tokens=64, eos_id=2), generators)
    decoded.tokens[0], decoded.truncated[0]        # the first row's new ids (through its EOS), cut short?

The contract: a row's tokens depend only on the model, its prompt, the settings and its own generator,
never on its batch mates, their number, order or lengths. Rows are left-padded, each row's first real token
sits at position 0, no token attends a padded one, and each row's token is drawn from one uniform of its
own generator (fntrain.sampling.pick). The matrix kernels do not promise bitwise equal logits across
paddings and batch sizes; a token flips only if that rounding (about 1e-7 relative in float32) carries a
cumulative probability across the row's uniform, or turns a near tie at temperature 0.

Three ways through a model, chosen by what it has (duck-typed: nothing here imports models/ or
transformers):
- the tiny GPT (`new_kv_cache`): the padded prompts fill its KV cache in one forward, then each step feeds
  one token per row. Its learned positions end at `model.cfg.context`: a prompt keeps its last `context`
  tokens, and once the cache's columns are full every step recomputes the last `context` columns (each row
  its last `context` tokens at positions from 0: nanoGPT's sliding window, the same tokens with or without
  the cache);
- a transformers causal LM (`config`, no `new_kv_cache`): fntrain's loop over the model's own cache (the
  first forward with the 2-D attention mask and per-row position ids, then one token per row with the cache
  it returned). `model.generate` is never called, the global RNG never drawn from, and the model's
  generation_config (repetition penalty and such) is not applied: only the settings are. Prompts are not
  cut: keeping prompt + max_new_tokens within the model's positions is the caller's;
- any other model: `model(input_ids)` of each row's last `context` tokens every step, rows of one length
  together (nothing is assumed of its masks or positions).
`kv_cache=False` recomputes every step on the first two as well (a reference, and the benchmark's).

Rows stop at their EOS (kept as their last token) or after `max_new_tokens`; decoding ends when every row
has stopped (finished rows keep being fed the tokens they draw, which are discarded). Under no_grad per
forward; the model's train/eval mode is the caller's; compiled blocks run eagerly (they would recompile for
every length).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fntrain.sampling.pick import draw_uniforms, pick_tokens
from fntrain.sampling.settings import SampleSettings, eos_ids

__all__ = ["Decoded", "decode", "sample_tokens", "model_context"]

Forward = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
"""(ids [B, T] left-padded, real [B, T] 1 on real tokens, each row's real length) -> last logits [B, V]."""


@dataclass(frozen=True)
class Decoded:
    """Each row's new token ids (through its EOS when it wrote one) and whether it stopped without one
    (max_new_tokens reached, or `keep_going` said stop)."""

    tokens: list[list[int]]
    truncated: list[bool]


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


def decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    settings: SampleSettings,
    generators: Sequence[torch.Generator | None],
    *,
    device: torch.device | str | None = None,
    on_tokens: Callable[[list[int | None]], None] | None = None,
    keep_going: Callable[[bool], bool] | None = None,
    kv_cache: bool = True,
    prefill_inputs: Mapping[str, torch.Tensor] | None = None,
) -> Decoded:
    """The new tokens of every prompt (lists of token ids, each non-empty), row i drawn from
    `generators[i]` (None: a fresh, nondeterministically seeded one; unused at temperature 0). A row's
    generator advances by one draw per token of that row.

    `device`: where the ids go (None: the model's parameters'). `on_tokens(step)` is called once per step
    with each row's new token (None for a row that had already stopped), e.g. to stream one row.
    `keep_going(any_row_unfinished_here)` is called before each forward after the first and says whether
    to go on (default: that answer); under FSDP2 pass an all-reduce of it, so every rank runs the same
    forwards. `kv_cache=False`: recompute every step. `prefill_inputs`: more inputs of a transformers
    model's first forward ([B, ...] each, a VLM's pixel_values; with kv_cache=False, of every forward)."""
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in _steps(model, prompts, settings, generators, device, keep_going, kv_cache, prefill_inputs):
        for row, token in enumerate(step):
            if token is not None:
                tokens[row].append(token)
        if on_tokens is not None:
            on_tokens(step)
    stops = eos_ids(settings)
    return Decoded(tokens, [not row or row[-1] not in stops for row in tokens])


def sample_tokens(
    model: Any, prompt_ids: torch.Tensor, settings: SampleSettings, generator: torch.Generator | None = None
) -> Iterator[int]:
    """Streams the new token ids of one sequence continuing `prompt_ids` (a 1-D LongTensor, at least one
    token, on the model's device): `decode` of one row, token by token. Greedy at temperature 0; the EOS
    is yielded, then the stream ends; a prompt longer than the tiny GPT's context keeps its last `context`
    tokens."""
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt_ids.shape)}"
        )
    for (token,) in _steps(
        model, [prompt_ids.tolist()], settings, [generator], prompt_ids.device, None, True, None
    ):
        if token is not None:
            yield token


def _steps(
    model: Any,
    prompts: Sequence[Sequence[int]],
    settings: SampleSettings,
    generators: Sequence[torch.Generator | None],
    device: torch.device | str | None,
    keep_going: Callable[[bool], bool] | None,
    kv_cache: bool,
    prefill_inputs: Mapping[str, torch.Tensor] | None,
) -> Iterator[list[int | None]]:
    """Each step's new token per row (None: the row had stopped); the loop `decode` and `sample_tokens`
    share."""
    settings.validate()
    prompts = _checked(prompts, generators)
    generators = _fresh(generators, settings)
    hf = hasattr(model, "config") and not hasattr(model, "new_kv_cache")
    context = None if hf else model_context(model)
    prompts = [prompt[-context:] for prompt in prompts] if context else prompts
    device = torch.device(device) if device is not None else _device(model)
    lengths = [len(prompt) for prompt in prompts]
    ids, real = _left_padded(prompts, settings.max_new_tokens, device)
    forward = _forward(model, hf, context, kv_cache, dict(prefill_inputs or {}))
    stops, done = eos_ids(settings), [False] * len(prompts)
    width = max(lengths)
    logits = forward(ids[:, :width], real[:, :width], lengths)
    for produced in range(settings.max_new_tokens):
        picked = pick_tokens(logits, settings, _uniforms(generators, done, settings, logits.device))
        step = [None if stopped else token for stopped, token in zip(done, picked.tolist(), strict=True)]
        done = [stopped or token in stops for stopped, token in zip(done, step, strict=True)]
        yield step
        if produced + 1 == settings.max_new_tokens:
            return
        unfinished = not all(done)
        if not (keep_going(unfinished) if keep_going is not None else unfinished):
            return
        ids[:, width], real[:, width] = picked, 1
        width, lengths = width + 1, [length + 1 for length in lengths]
        logits = forward(ids[:, :width], real[:, :width], lengths)


def _checked(prompts: Sequence[Sequence[int]], generators: Sequence[Any]) -> list[list[int]]:
    """The prompts as lists of ints; a `ValueError` naming what is wrong."""
    if not prompts:
        raise ValueError("decode needs at least one prompt, got none")
    if len(generators) != len(prompts):
        raise ValueError(
            f"decode needs one generator per prompt: {len(prompts)} prompts, {len(generators)} generators"
        )
    rows = [[int(token) for token in prompt] for prompt in prompts]
    empty = [index for index, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"prompts {empty} have no tokens: every prompt needs at least one")
    return rows


def _fresh(generators: Sequence[torch.Generator | None], settings: SampleSettings) -> list[Any]:
    """The generators, a nondeterministically seeded one in place of each None when sampling."""
    if settings.temperature == 0:
        return list(generators)
    return [generator if generator is not None else _seeded() for generator in generators]


def _seeded() -> torch.Generator:
    generator = torch.Generator()
    generator.seed()
    return generator


def _uniforms(generators: list[Any], done: list[bool], settings: SampleSettings, device: torch.device) -> Any:
    """One uniform per row from its own generator; rows that stopped draw nothing (their pick is
    discarded, 0.5 stands in). None at temperature 0."""
    if settings.temperature == 0:
        return None
    live = [index for index, stopped in enumerate(done) if not stopped]
    uniforms = torch.full((len(done),), 0.5)
    if live:  # none while keep_going runs the forwards of a rank whose rows have all stopped
        uniforms[live] = draw_uniforms([generators[index] for index in live])
    return uniforms.to(device)


def _device(model: Any) -> torch.device:
    parameter = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return parameter.device if parameter is not None else torch.device("cpu")


def _left_padded(
    prompts: list[list[int]], room: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and real [B, longest + room]: each prompt at the right end of the longest's columns (pad id 0,
    never attended), room for the new tokens after it."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros(len(prompts), width + room, dtype=torch.long)
    real = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) : width] = torch.tensor(prompt, dtype=torch.long)
        real[row, width - len(prompt) : width] = 1
    return ids.to(device), real.to(device)


def _positions(real: torch.Tensor) -> torch.Tensor:
    """Each row's positions, its first real token at 0 (padding at 0 too: it is never attended)."""
    return (real.cumsum(-1) - 1).clamp_(min=0)


def _eager() -> Any:
    """Compiled blocks (--parallel.compile) run eagerly while sampling: they would recompile for every
    length. Only a process that compiled has torch._dynamo loaded; importing it here just to say so would
    cost every other process about a second."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def _last_logits(output: Any) -> torch.Tensor:
    """The last column's logits [B, V] of a forward's output (a MoE or an HF output: its `.logits`)."""
    return getattr(output, "logits", output)[:, -1]


def _forward(model: Any, hf: bool, context: int | None, kv_cache: bool, extra: dict[str, Any]) -> Forward:
    """The model's forward for the decode loop, by what the model is (module doc); no_grad and eager."""
    if hf:
        inner = _hf_forward(model, kv_cache, extra)
    elif hasattr(model, "new_kv_cache"):
        inner = _tiny_forward(model, kv_cache)
    else:
        inner = _plain_forward(model, context)

    def forward(ids: torch.Tensor, real: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        with torch.no_grad(), _eager():
            return inner(ids, real, lengths)

    return forward


def _tiny_forward(model: Any, kv_cache: bool) -> Forward:
    """The tiny GPT through its KV cache: the first call fills it, later calls feed the new columns; a
    full cache (or kv_cache=False) recomputes the last `context` columns into a fresh one."""
    context, cache = model.cfg.context, None

    def forward(ids: torch.Tensor, real: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        nonlocal cache
        if kv_cache and cache is not None and cache.length < context:
            fed = cache.length
        else:
            ids, real, fed, cache = ids[:, -context:], real[:, -context:], 0, model.new_kv_cache()
        padded = min(lengths) < ids.size(1)  # a row shorter than the columns: its first ones are padding
        mask = real[:, fed:] if padded else None
        positions = _positions(real)[:, fed:] if padded else None
        return _last_logits(model(ids[:, fed:], position_ids=positions, attention_mask=mask, kv_cache=cache))

    return forward


def _hf_forward(model: Any, kv_cache: bool, extra: dict[str, Any]) -> Forward:
    """A transformers causal LM over its own cache (named `cache` from transformers 5.25 on, before
    `past_key_values`), with the 2-D mask (left out without padding, as `generate` does) and per-row
    positions; only the last position's logits are computed where the model offers `logits_to_keep`."""
    cache_name = "cache" if _accepts(model, "cache") else "past_key_values"
    keep = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    state: dict[str, Any] = {"fed": 0, "cache": None}

    def forward(ids: torch.Tensor, real: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        mask = real if min(lengths) < ids.size(1) else None
        fed = state["fed"] if kv_cache else 0
        inputs = {cache_name: state["cache"]} if fed else extra
        output = model(input_ids=ids[:, fed:], attention_mask=mask, position_ids=_positions(real)[:, fed:],
                       use_cache=kv_cache, **inputs, **keep)  # fmt: skip
        if kv_cache:
            state["fed"], state["cache"] = ids.size(1), getattr(output, cache_name)
        return _last_logits(output)

    return forward


def _accepts(model: Any, name: str) -> bool:
    """Whether the model's forward (a peft wrapper's base model's) names the keyword `name`."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return name in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def _plain_forward(model: Any, context: int | None) -> Forward:
    """Any other model: `model(input_ids)` of each row's last `context` real tokens, rows of one length
    together (the real tokens of a left-padded row are its last `length` columns)."""

    def forward(ids: torch.Tensor, real: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(lengths):
            groups.setdefault(min(length, context) if context else length, []).append(row)
        order, parts = [], []
        for width, rows in groups.items():
            parts.append(_last_logits(model(ids[rows, -width:])))
            order += rows
        return torch.cat(parts)[torch.tensor(order, device=ids.device).argsort()]

    return forward
