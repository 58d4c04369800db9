"""DPO: fntrain's preference step against the same step written by hand, and the adapter-off reference
against a frozen copy of the model (step time and peak memory).

The model is a Llama built here from a config (nothing is downloaded: 4 layers, hidden 256, vocabulary
2048, about 4.2 M parameters), big enough that its matrices, not Python, dominate a step on one CPU
thread. The micro-batch is fntrain's preference collate of 2 synthetic pairs (a 48-token prompt, chosen
and rejected completions of 80 and 64 tokens: 4 rows of 128 positions, padding masked). Variants, one
step each per round, alternated by `interleave` (paired rounds, process CPU time, one thread):

- **fntrain**: `make_train_step` with `make_dpo_forward(frozen_reference(copy))` and
  `make_dpo_loss(DPOConfig())` (sigmoid, beta 0.1), AdamW, loss weighting "mean", no clipping;
- **hand-written**: the same work in plain PyTorch on the *same* policy, reference and batch: the
  reference's forward under `no_grad`, the policy's forward on the 2B rows, `log_softmax(...).gather`
  summed over the completion, `-logsigmoid(beta * delta).mean()`, backward, `AdamW.step()`,
  `zero_grad()` (its own AdamW, same settings). fntrain's step also computes TRL's eight metrics
  (`rewards/*`, `logps/*`, `logits/*`: a vocabulary-mean of the logits) that the hand-written one skips;
- **adapter-off**: fntrain's step, a LoRA policy (rank 8, all linear layers, peft) whose reference is
  itself with the adapter disabled (`adapter_off_reference`);
- **copy**: the same LoRA policy (same weights) with a frozen copy of the base model as the reference.

After the rounds the DPO loss and the mean chosen and rejected log-probs of both are compared on the
trained policy (they must agree: the same work), and one step of each variant is measured for memory.
A step's peak is the bytes of every tensor it holds when it starts (weights, reference weights, AdamW
moments, the batch) plus the peak of what it allocates above that: on CUDA the rise of
`torch.cuda.max_memory_allocated`; on CPU, where torch keeps no peak counter, the peak of the torch
profiler's allocation events during the step (allocations +, frees -, in time order), the CPU twin of
CUDA's allocated-bytes peak. Not RSS, which also counts the allocator's cached pages and the libraries.

Run: `python -m bench.dpo [--quick] [--json FILE]` (`--quick`: one round, checks that it runs;
a full run is 12 to 40 rounds: 18 rounds, about 3 min, on 2 busy cores).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from bench.harness import Row, Target, bench_main, interleave, paired_ratio_row, quiet, ratio_row
from fntrain.data.tokens import IGNORE_INDEX

SHAPE = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=256,
)  # fmt: skip
PAIRS, PROMPT, CHOSEN, REJECTED = 2, 48, 80, 64
BETA, LR, RANK = 0.1, 1e-5, 8
WHERE = "Llama 4x256, vocab 2048, 2 pairs of 128 tokens, CPU 1 thread"


def _base() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def _batch() -> dict[str, torch.Tensor]:
    """Two preference pairs through fntrain's collate: chosen rows first, prompt and padding masked."""
    from fntrain.data.preference_collate import make_preference_collate

    generator = torch.Generator().manual_seed(1)
    examples = []
    for index in range(PAIRS):
        prompt = torch.randint(1, SHAPE["vocab_size"], (PROMPT,), generator=generator).tolist()
        example = {"index": index}
        for side, length in (("chosen", CHOSEN), ("rejected", REJECTED)):
            answer = torch.randint(1, SHAPE["vocab_size"], (length,), generator=generator).tolist()
            example[f"{side}_input_ids"] = prompt + answer
            example[f"{side}_labels"] = [IGNORE_INDEX] * PROMPT + answer
        examples.append(example)
    return make_preference_collate(pad_id=0, pad_multiple=8)(examples)


def _summed_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch (the baseline): next-token log-probs summed over each row's completion tokens."""
    targets = labels[:, 1:]
    valid = targets != IGNORE_INDEX
    per_token = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    per_token = per_token.gather(-1, targets.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    return per_token.masked_fill(~valid, 0.0).sum(-1)


def _hand_written_loss(
    policy: torch.nn.Module, reference: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """DPO's sigmoid loss as one writes it from the paper: the reference under no_grad, then the policy."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        reference_logps = _summed_logps(reference(**inputs).logits, batch["labels"])
    logps = _summed_logps(policy(**inputs).logits, batch["labels"])
    ratios = logps - reference_logps
    delta = ratios[:PAIRS] - ratios[PAIRS:]
    return -F.logsigmoid(BETA * delta).mean()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)


def _fntrain_step(
    policy: torch.nn.Module, reference: Callable, optimizer: torch.optim.Optimizer
) -> Callable[[dict], object]:
    from fntrain.state import TrainState
    from fntrain.step import StepSettings, make_train_step
    from fntrain.step.objectives import DPOConfig, make_dpo_forward, make_dpo_loss

    step_fn = make_train_step(
        policy, make_dpo_loss(DPOConfig(beta=BETA)), optimizer, settings=StepSettings(loss_weighting="mean"),
        forward=make_dpo_forward(reference),
    )  # fmt: skip
    return lambda batch: step_fn(TrainState(), batch)


def _hand_written_step(
    policy: torch.nn.Module, reference: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[dict], object]:
    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = _hand_written_loss(policy, reference, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _build() -> dict[str, tuple[Callable[[dict], object], list[torch.nn.Module], torch.optim.Optimizer]]:
    """name -> (step(batch), the modules whose tensors it holds, its optimizer)."""
    from fntrain.models.lora import LoraConfig, apply_lora
    from fntrain.step.objectives import adapter_off_reference, frozen_reference

    policy, reference = _base(), _base().eval()
    built = {}
    optimizer = _adamw(policy)
    built["fntrain"] = (
        _fntrain_step(policy, frozen_reference(reference), optimizer),
        [policy, reference],
        optimizer,
    )
    optimizer = _adamw(policy)  # its own moments, the same policy and reference
    built["hand-written"] = (_hand_written_step(policy, reference, optimizer), [policy, reference], optimizer)
    lora = LoraConfig(rank=RANK, alpha=16.0)
    adapted = apply_lora(_base(), lora, seed=0)
    optimizer = _adamw(adapted)
    built["adapter-off"] = (_fntrain_step(adapted, adapter_off_reference(), optimizer), [adapted], optimizer)
    adapted, frozen = apply_lora(_base(), lora, seed=0), _base().eval()
    optimizer = _adamw(adapted)
    built["copy"] = (
        _fntrain_step(adapted, frozen_reference(frozen), optimizer),
        [adapted, frozen],
        optimizer,
    )
    return built


def _held_bytes(modules: Iterable[torch.nn.Module], optimizer: torch.optim.Optimizer, batch: dict) -> int:
    """Bytes of the distinct storages of the modules' parameters, gradients and buffers, the optimizer's
    state and the batch: what is allocated before a step starts."""
    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    tensors += [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    tensors += [t for t in batch.values() if torch.is_tensor(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _weight_bytes(modules: Iterable[torch.nn.Module]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in modules for t in (*m.parameters(), *m.buffers())}  # fmt: skip
    return sum(storages.values())


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto writes a line to the process's stderr when a profile starts and stops: not into the table."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _cpu_step_peak(step: Callable[[], object]) -> int:
    """Peak bytes of CPU tensor storage allocated during `step()` above what was live when it started:
    the torch profiler's allocation events (+ on allocation, - on free) summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def _peak_bytes(name: str, built: dict, batch: dict) -> int:
    """The peak memory of one step of `name` (after warm steps: the optimizer's state exists): the
    tensors it holds at the start plus the peak of what it allocates above that (on CUDA from the
    allocator's counters, which would also count the other variants' models if read whole)."""
    step, modules, optimizer = built[name]
    held = _held_bytes(modules, optimizer, batch)
    if not torch.cuda.is_available():
        return held + _cpu_step_peak(lambda: step(batch))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step(batch)
    torch.cuda.synchronize()
    return held + torch.cuda.max_memory_allocated() - start


def _same_loss(built: dict, batch: dict) -> float:
    """fntrain's DPO loss and mean chosen and rejected log-probs on the trained policy against the
    hand-written ones (the baseline must do the same work; the log-probs still differ where a policy
    that learned the one batch has driven the loss to 0); returns the loss."""
    from fntrain.step.objectives import DPOConfig, frozen_reference, make_dpo_forward, make_dpo_loss

    policy, reference = built["fntrain"][1]
    with torch.no_grad():
        output = make_dpo_forward(frozen_reference(reference))(policy, batch)
        loss, metrics = make_dpo_loss(DPOConfig(beta=BETA))(output, batch)
        ours = torch.stack([loss, metrics["logps/chosen"], metrics["logps/rejected"]])
        logps = _summed_logps(output.logits, batch["labels"])
        theirs = _hand_written_loss(policy, reference, batch)
        theirs = torch.stack([theirs, logps[:PAIRS].mean(), logps[PAIRS:].mean()])
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6):
        raise AssertionError(
            f"fntrain's DPO loss, chosen and rejected log-probs {ours.tolist()} differ from the "
            f"hand-written {theirs.tolist()}"
        )
    return loss.item()


def measure(quick: bool):
    """(timing, peak bytes per variant, weight bytes per variant, the loss both steps agree on)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    built = _build()
    if device.type == "cuda":
        for _, modules, _ in built.values():
            for module in modules:
                module.to(device)
    batch = {key: value.to(device) for key, value in _batch().items()}
    steps = 1  # a step is about 0.6 s of CPU here: rounds of one step each give more pairs to bootstrap

    def variant(step):
        def round_() -> int:
            for _ in range(steps):
                step(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return steps

        return round_

    targets = [
        Target("fntrain", "hand-written", 0.03, ratio=True),
        Target("adapter-off", "copy", 0.03, ratio=True),
    ]
    timing = interleave(
        {name: variant(step) for name, (step, _, _) in built.items()}, repeats=1 if quick else 12,
        warmup=0 if quick else 1, targets=() if quick else targets, budget_s=0.0 if quick else 240.0,
        max_repeats=40,
        clock=time.perf_counter if device.type == "cuda" else time.process_time,
    )  # fmt: skip
    peaks = {name: _peak_bytes(name, built, batch) for name in built}
    weights = {name: _weight_bytes(modules) for name, (_, modules, _) in built.items()}
    return timing, peaks, weights, _same_loss(built, batch)


def run(quick: bool = False) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
            timing, peaks, weights, loss = measure(quick)
    finally:
        torch.set_num_threads(threads)
    where = WHERE if not torch.cuda.is_available() else WHERE.replace("CPU 1 thread", "CUDA")
    peak = (
        "max_memory_allocated's rise" if torch.cuda.is_available() else "the profiler's peak of allocations"
    )
    memory = f"tensors held at the step's start + {peak} during it"
    mib = 2**20
    hand = "frozen-copy reference, full fine-tuning; the same loss after the rounds"
    logits = (
        "the hand-written log_softmax keeps a float32 (2B, T, V) tensor for the backward (fntrain's "
        "completion_logps the normaliser): it shows only where the logits are alive at the peak"
    )
    return [
        paired_ratio_row(
            f"DPO step: fntrain vs the same step written by hand ({where})", timing, "fntrain",
            "hand-written", goal_ratio=None,
            note=f"{hand} ({loss:.4f}); fntrain also computes TRL's 8 metrics",
        ),
        ratio_row(
            "DPO step peak memory: fntrain / hand-written", peaks["fntrain"] / mib,
            peaks["hand-written"] / mib, unit="MiB", goal_ratio=None, note=f"{memory}; {logits}",
        ),
        paired_ratio_row(
            f"DPO step with LoRA: adapter-off reference vs a frozen copy ({where})", timing, "adapter-off",
            "copy", goal_ratio=None, note=f"rank {RANK} all-linear; the reference's forward runs through the "
            "disabled adapters' wrappers instead of a plain model",
        ),
        ratio_row(
            "DPO with LoRA, weights held: adapter-off / frozen copy", weights["adapter-off"] / mib,
            weights["copy"] / mib, unit="MiB", goal_ratio=None,
            note="parameters and buffers of the policy (base + adapters) and of the reference",
        ),
        ratio_row(
            "DPO with LoRA, peak step memory: adapter-off / frozen copy", peaks["adapter-off"] / mib,
            peaks["copy"] / mib, unit="MiB", goal_ratio=None, note=memory,
        ),
    ]  # fmt: skip


if __name__ == "__main__":
    quiet()
    bench_main(run, "DPO: fntrain's step vs by hand, adapter-off vs frozen copy", __doc__.splitlines()[0])
