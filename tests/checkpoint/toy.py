"""A small model + optimizer + schedule for checkpoint tests: tied weights, dropout (so the RNG matters),
AdamW (moments and a step count), a LambdaLR (its own state)."""

from __future__ import annotations

import torch

from fntrain.step.components import Components


class Toy(torch.nn.Module):
    def __init__(self, width: int = 8, vocab: int = 16, extra: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.drop = torch.nn.Dropout(0.2)
        if extra:
            self.extra = torch.nn.Linear(width, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.drop(torch.relu(self.hidden(self.embed(ids))))))


def components(seed: int = 0, *, extra: bool = False, optimizer: bool = True) -> Components:
    torch.manual_seed(seed)
    model = Toy(extra=extra)
    if not optimizer:
        return Components(model, None, ())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    return Components(model, None, (opt,), (schedule,))


def batches(count: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 16, (4, 6), generator=generator) for _ in range(count)]


def step(parts: Components, ids: torch.Tensor) -> float:
    """One optimizer step; returns the loss as a float (exact, for == comparisons)."""
    logits = parts.model(ids)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), ids.reshape(-1))
    loss.backward()
    for opt in parts.optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    for schedule in parts.schedulers:
        schedule.step()
    return loss.item()


def weights(parts: Components) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in parts.model.state_dict().items()}


def same_weights(a: Components, b: Components) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def two_checkpoints(root) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """step_2 and step_4 of one toy run saved under `root` (every rank calls it under a process group);
    returns the weights at each."""
    from fntrain.checkpoint import SaveTarget, save
    from fntrain.state import TrainState

    parts = components()
    data = batches(4)
    for ids in data[:2]:
        step(parts, ids)
    save(SaveTarget(root, parts), TrainState(0, 2, 2))
    at_2 = weights(parts)
    for ids in data[2:]:
        step(parts, ids)
    save(SaveTarget(root, parts), TrainState(0, 4, 4))
    return at_2, weights(parts)
