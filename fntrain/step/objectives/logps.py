"""Log-probabilities of the completion tokens: what the preference and RL losses compare.

`completion_logps(logits, labels)` scores each row's completion (the tokens whose label is not
`ignore_index`: the data side masks the prompt and the padding) as TRL does: next-token log-probs
summed over the completion, EOS included, no length averaging. `token_logps(logits, labels,
temperature)` keeps them per token, of the distribution softmax(logits / temperature) GRPO samples
from, and `token_entropy(logits, temperature)` is that distribution's entropy per position (no
gradient), as TRL's fused LM head computes both. Written here rather than calling TRL so a run needs
no TRL, and with a backward of its own so low-precision logits never get a full float32 copy kept
for the backward (TRL's non-Triton path takes the bf16 log-softmax instead, less precisely).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fntrain.data.tokens import IGNORE_INDEX

__all__ = ["completion_logps", "token_logps", "token_entropy", "output_logits", "full_logits"]


def output_logits(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or its `.logits` (Hugging Face)."""
    return output.logits if hasattr(output, "logits") else output


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits split over the vocabulary (a DTensor: tensor parallelism with parallel.loss_parallel)
    gathered whole on every rank, differentiably (the gradient goes back to the shards); a plain
    tensor as it is. The preference and distillation losses need whole rows of the vocabulary (and
    take their own float32 chunking), so under tensor parallelism they cost the full logits per rank."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


# About 256 MiB of float32 per chunk: the largest temporary the log-normaliser and its gradient make.
_CHUNK_ELEMENTS = 1 << 26


def _position_chunks(logits: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """(row, positions) chunks of (N, T, V) logits, each at most `_CHUNK_ELEMENTS` logits."""
    step = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    for row in range(logits.shape[0]):
        for start in range(0, logits.shape[1], step):
            yield row, slice(start, start + step)


class _TokenLogProbs(torch.autograd.Function):
    """log p(target) per position of softmax(scale * logits), float32, saving only the logits (no
    copy) and the normaliser.

    Autograd through `log_softmax(logits.float())` would keep a float32 copy of the whole logits tensor
    for the backward (twice the size of bf16 logits); here each chunk's float32 copy lives only while
    it is used, and the backward recomputes the softmax chunk by chunk. `scale` is 1 / temperature
    (a Python float; at 1.0 no multiply happens, so the numbers are those of the unscaled logits)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        normaliser = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for row, positions in _position_chunks(logits):
            normaliser[row, positions] = torch.logsumexp(_scaled(logits[row, positions], scale), dim=-1)
        ctx.save_for_backward(logits, targets, normaliser)
        ctx.scale = scale
        return _scaled(logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1), scale) - normaliser

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, normaliser = ctx.saved_tensors
        scale = ctx.scale
        grad_logits = torch.empty_like(logits)
        for row, positions in _position_chunks(logits):
            # d log p(target) / d logits = scale * (onehot(target) - softmax(scale * logits))
            upstream = grad[row, positions].unsqueeze(-1)
            if scale != 1.0:
                upstream = upstream * scale
            chunk = torch.exp(
                _scaled(logits[row, positions], scale) - normaliser[row, positions].unsqueeze(-1)
            )
            chunk.mul_(-upstream).scatter_add_(-1, targets[row, positions].unsqueeze(-1), upstream)
            grad_logits[row, positions] = chunk
        return grad_logits, None, None


def _scaled(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """`logits` in float32 times `scale` (no multiply at 1.0). Multiplied by 1 / temperature rather than
    divided by it, as TRL's fused LM head does, so the two agree to the last bit more often."""
    logits = logits.float()
    return logits if scale == 1.0 else logits * scale


def _inverse_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return 1.0 / temperature


def completion_logps(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logps_sum, token_count)`, both (N,): per row, the float32 sum of log p(label[t+1] | ..t)
    over the positions whose label is not `ignore_index`, and the number of those positions (int64).

    `logits` (N, T, V) in any dtype, `labels` (N, T) unshifted (logits[:, :-1] predict labels[:, 1:]).
    Memory: only the chosen logits are gathered and the log-normaliser (logsumexp over the vocabulary)
    is taken in float32 a chunk of positions at a time, forward and backward, so no full-size float32
    copy of low-precision logits ever exists (TRL's `selective_log_softmax` loops over rows for the
    same reason). A row without completion tokens sums to 0. No host sync. Vocabulary-parallel
    (DTensor) logits are gathered first (`full_logits`).
    """
    per_token = token_logps(logits, labels, 1.0, ignore_index)
    return per_token.sum(-1), (labels[:, 1:] != ignore_index).sum(-1)


def token_logps(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """(N, T-1) float32, with gradient: log p(label[t+1] | ..t) under softmax(logits[:, t] / temperature)
    at every position whose label is not `ignore_index`, 0 elsewhere (TRL's fused LM head's
    `log_probs`). `logits` (N, T, V) in any dtype, `labels` (N, T) unshifted. Same memory scheme as
    `completion_logps` (chunked float32, no full-size float32 copy kept); no host sync. Vocabulary-parallel
    (DTensor) logits are gathered first (`full_logits`)."""
    logits = full_logits(logits)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ in their (rows, positions)"
        )
    targets = labels[:, 1:]
    valid = targets != ignore_index
    scale = _inverse_temperature(temperature)
    per_token = _TokenLogProbs.apply(logits[:, :-1], targets.masked_fill(~valid, 0), scale)
    # masked_fill, not a product with the mask: an ignored position never reaches a sum (0 * -inf is NaN).
    return per_token.masked_fill(~valid, 0.0)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(N, T-1) float32, without gradient: the entropy of softmax(logits[:, t] / temperature) at every
    position but the last (the distributions that predict labels[:, 1:]), computed a chunk of positions
    at a time in float32 (no full-size float32 copy). Vocabulary-parallel logits are gathered first."""
    scale = _inverse_temperature(temperature)
    with torch.no_grad():
        logits = full_logits(logits).detach()[:, :-1]
        entropy = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for row, positions in _position_chunks(logits):
            scaled = _scaled(logits[row, positions], scale)
            normaliser = torch.logsumexp(scaled, dim=-1, keepdim=True)
            # H = log Z - sum_v p_v z_v, with p = exp(z - log Z)
            weighted = torch.exp(scaled - normaliser).mul_(scaled).sum(-1)
            entropy[row, positions] = normaliser.squeeze(-1) - weighted
        return entropy
