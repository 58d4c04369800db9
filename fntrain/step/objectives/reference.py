"""Where a reference model's log-probs come from: three `reference(model, micro_batch)` functions.

Each returns, computed without gradient, DPO's (2B,) float32 summed completion log-probs of the
micro-batch's rows (chosen rows 0..B-1, then rejected rows), or with a `score` function of its own what
that makes of the output (GRPO: per-token log-probs):

    frozen_reference(reference_model)        a frozen copy of the starting model, run every step
    adapter_off_reference()                  the policy itself with its LoRA adapter switched off
    precomputed_reference(table)             looked up by the micro-batch's "index" in a table that
                                             precompute_reference_logps filled once before training

`make_dpo_forward` (dpo.py) calls the chosen one inside the step's forward, so it runs under the
step's autocast, as TRL's reference forward does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from fntrain.data.device import to_device
from fntrain.step.losses import default_forward
from fntrain.step.objectives.logps import completion_logps, output_logits

__all__ = [
    "Reference",
    "frozen_reference",
    "adapter_off_reference",
    "precomputed_reference",
    "precompute_reference_logps",
]

Forward = Callable[[torch.nn.Module, Mapping[str, Any]], Any]
Reference = Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor]
Score = Callable[[Any, Mapping[str, Any]], torch.Tensor] | None


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode inside the block; every module's own training flag restored after it (a
    plain `train()` would also switch on modules that were deliberately left in eval mode)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _summed_logps(output: Any, micro_batch: Mapping[str, Any]) -> torch.Tensor:
    return completion_logps(output_logits(output), micro_batch["labels"])[0]


def frozen_reference(reference_model: torch.nn.Module, forward: Forward = default_forward,
                     score: Score = None) -> Reference:  # fmt: skip
    """The reference log-probs from `reference_model` (a frozen copy of the starting model, plain or
    FSDP2-sharded): put in eval mode here and called under `torch.no_grad()`; the policy passed in is
    not used. `score(output, micro_batch)` turns the output into log-probs (default: DPO's summed
    completion log-probs; GRPO passes its per-token ones)."""
    reference_model.eval()
    score = score or _summed_logps

    def reference(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            return score(forward(reference_model, micro_batch), micro_batch)

    return reference


def _find_peft_model(model: torch.nn.Module) -> Any:
    """The peft `PeftModel` in `model` (itself, or under a wrapper); ValueError when there is none.

    Found by what it offers (`peft_config` and the `disable_adapter()` context), not by class: no peft
    import here, and peft's inner tuner (`LoraModel`, which has no `disable_adapter`) is skipped."""
    found = next(
        (m for m in model.modules() if hasattr(m, "peft_config") and hasattr(m, "disable_adapter")), None
    )
    if found is None:
        raise ValueError(
            "dpo.reference 'adapter-off' needs a LoRA model (peft's PeftModel, --lora.rank > 0): "
            f"the policy is a {type(model).__name__}"
        )
    return found


def adapter_off_reference(forward: Forward = default_forward, score: Score = None) -> Reference:
    """The reference log-probs from the policy itself with its LoRA adapter disabled (peft's
    `disable_adapter()`): the base model it started from, with no second copy in memory. Under DDP the
    wrapped module is called (no gradient-sync bookkeeping for a forward without backward); FSDP2
    shards in place, so its module is called as it is. The model is in eval mode for this forward
    (no dropout, no activation checkpointing) and every module's training flag is restored after it.
    `score` as for `frozen_reference`."""
    found: dict[int, Any] = {}  # id(model) -> its PeftModel: the module walk happens once per model
    score = score or _summed_logps

    def reference(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        if id(inner) not in found:
            found.clear()
            found[id(inner)] = _find_peft_model(inner)
        with torch.no_grad(), _eval_mode(inner), found[id(inner)].disable_adapter():
            return score(forward(inner, micro_batch), micro_batch)

    return reference


def precomputed_reference(table: torch.Tensor) -> Reference:
    """The reference log-probs looked up in `table` ((N, 2) float32: [chosen, rejected] per pair, as
    `precompute_reference_logps` returns it) at the micro-batch's "index" ((B,) pair indices). Device
    ops only (no host sync); keep the table on the training device."""
    if table.dim() != 2 or table.shape[1] != 2:
        raise ValueError(f"the reference table must be (pairs, 2), got {tuple(table.shape)}")

    def reference(model: torch.nn.Module, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        index = micro_batch["index"]
        rows = table[index.to(table.device)].to(index.device)
        return torch.cat([rows[:, 0], rows[:, 1]])

    return reference


def precompute_reference_logps(
    reference_model: torch.nn.Module,
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], Mapping[str, Any]],
    micro_batch_size: int,
    device: torch.device | str,
    forward: Forward = default_forward,
) -> torch.Tensor:
    """The (N, 2) float32 table [chosen, rejected] of summed reference log-probs of every pair of the
    map-style `dataset`, on `device`: its items in order, `micro_batch_size` at a time, through
    `collate` (a preference micro-batch; a row's place is its "index" when the batch has one, else its
    position), under `torch.no_grad()` with the model in eval mode (flags restored after). Every rank
    must run it over the whole dataset, so a collective-sharded (FSDP2) reference stays in step; call
    it under the run's autocast when training uses one. The caller frees the reference afterwards."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    device = torch.device(device)
    table = torch.zeros(len(dataset), 2, dtype=torch.float32, device=device)
    with torch.no_grad(), _eval_mode(reference_model):
        for start in range(0, len(dataset), micro_batch_size):
            items = [dataset[i] for i in range(start, min(start + micro_batch_size, len(dataset)))]
            micro_batch = to_device(collate(items), device)
            logps = _summed_logps(forward(reference_model, micro_batch), micro_batch)
            pairs = len(items)
            if logps.shape[0] != 2 * pairs:
                raise ValueError(
                    f"collate made {logps.shape[0]} rows of {pairs} pairs: a preference micro-batch holds "
                    "each pair's chosen row (first half) and rejected row (second half)"
                )
            rows = micro_batch.get("index")
            rows = torch.arange(start, start + pairs, device=device) if rows is None else rows.to(device)
            table[rows] = torch.stack([logps[:pairs], logps[pairs:]], dim=1)
    return table
