"""Shared by the preference-loss tests: a toy 2-layer LM, a preference micro-batch, the naive sums."""

from __future__ import annotations

import math

import torch
from torch import nn

from fntrain.data.tokens import IGNORE_INDEX
from fntrain.step.objectives import disable_dropout

VOCAB, WIDTH, SEQ, PAIRS = 13, 8, 7, 3
METRIC_NAMES = {
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected",
}  # fmt: skip


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal within float32 rounding (torch.allclose: torch.testing.assert_close's first call costs seconds)."""
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=1e-5, atol=1e-6)


class ToyLM(nn.Module):
    """Two layers over an embedding, with a dropout layer; returns the logits tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.mix(self.embed(input_ids)))))


def toy_model(seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return disable_dropout(ToyLM())


def preference_batch(pairs: int = PAIRS, seed: int = 1, index: list[int] | None = None) -> dict:
    """2·pairs rows (chosen, then rejected): a prompt of 2-3 tokens masked, then a completion of at least
    two tokens, then padding masked; "index" the pairs' dataset indices."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2 * pairs, SEQ), generator=generator)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    for row in range(2 * pairs):
        prompt = 2 + row % 2
        end = SEQ - (row % 3)
        labels[row, :prompt] = IGNORE_INDEX
        labels[row, end:] = IGNORE_INDEX
        mask[row, end:] = 0
    index = torch.tensor(index if index is not None else list(range(pairs)))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "index": index}


def naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[list[float], list[int]]:
    sums, counts = [], []
    for row in range(logits.shape[0]):
        total, count = 0.0, 0
        for t in range(1, logits.shape[1]):
            if labels[row, t] != IGNORE_INDEX:
                total += torch.log_softmax(logits[row, t - 1].double(), -1)[labels[row, t]].item()
                count += 1
        sums.append(total)
        counts.append(count)
    return sums, counts


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))
