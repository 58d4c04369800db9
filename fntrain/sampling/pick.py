"""The next token of every row from its last position's logits: greedy, or an inverse-CDF draw of the
tempered, top-k and top-p cut distribution with one uniform per row.

    uniforms = draw_uniforms(generators, device=logits.device)      # [B], one draw from each row's own generator
    tokens = pick_tokens(logits, settings, uniforms)                 # [B] long

One uniform per row and token, drawn on the CPU from the row's own generator, decides the row's token: it
does not depend on the other rows, on the device, or on how many rows share the batch (a multinomial over
the batch would draw from one stream in row order). Inverse CDF: the first token whose cumulative
probability exceeds u times the total, so a token cut to probability 0 is never drawn, and a draw flips
only when the logits move enough to carry a cumulative sum across u.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fntrain.sampling.settings import SampleSettings

__all__ = ["pick_tokens", "draw_uniforms", "cut_scores"]


def draw_uniforms(
    generators: Sequence[torch.Generator], device: torch.device | str | None = None
) -> torch.Tensor:
    """One uniform in [0, 1) from each generator (each advances by one draw), as a [len] float32 tensor
    on `device`. Draws are made where each generator lives (the CPU for `row_generator`'s), so they do not
    depend on the device the model runs on; the vector then moves in one small copy."""
    draws = [torch.rand((), generator=g, device=g.device).cpu() for g in generators]
    uniforms = torch.stack(draws) if draws else torch.empty(0)
    return uniforms.to(device) if device is not None else uniforms


def cut_scores(logits: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
    """The float32 scores [B, V] of `logits` over the temperature with the tokens outside the top k and
    outside the nucleus of mass top_p set to -inf (the most likely token always stays). Temperature > 0."""
    scores = logits.float() / settings.temperature
    if settings.top_k and settings.top_k < scores.size(-1):
        kth = torch.topk(scores, settings.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token once the more likely ones already hold top_p; the most likely always stays.
        drop = probs.cumsum(-1) - probs >= settings.top_p
        drop[:, 0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scores


def pick_tokens(
    logits: torch.Tensor, settings: SampleSettings, uniforms: torch.Tensor | None
) -> torch.Tensor:
    """The next token [B] (long, on the logits' device) of each row of `logits` [B, V]: the argmax at
    temperature 0 (`uniforms` unused, may be None); otherwise the inverse-CDF draw of softmax(`cut_scores`)
    at each row's uniform in [0, 1) (`uniforms` [B], e.g. from `draw_uniforms`)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if settings.temperature == 0:
        return torch.argmax(logits, dim=-1)
    if uniforms is None or uniforms.shape != logits.shape[:1]:
        got = None if uniforms is None else tuple(uniforms.shape)
        raise ValueError(f"sampling at temperature {settings.temperature} needs one uniform per row "
                         f"({logits.size(0)}), got {got}")  # fmt: skip
    cumulative = torch.softmax(cut_scores(logits, settings), dim=-1).cumsum(-1)
    # Scaled by the row's total (which rounding leaves a hair off 1), u stays below the last cumulative
    # value, so the first token whose cumulative sum exceeds it exists and has a probability above 0.
    target = uniforms.to(cumulative.device, torch.float32)[:, None] * cumulative[:, -1:]
    picked = torch.searchsorted(cumulative, target, right=True)[:, 0]
    return picked.clamp_(max=logits.size(-1) - 1)
