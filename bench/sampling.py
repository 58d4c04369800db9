"""Sampling the tiny GPT: tokens per second with the KV cache against recomputing the window every token.

The tiny GPT of recipes/tiny_gpt.py (4 blocks, d_model 128, 4 heads) with its context raised to 1024
positions, so that 512 new tokens after an 8-token prompt never reach the window's end (past it both ways
recompute the window: see fntrain.sampling.decode). `fntrain.sampling.sample_tokens`, greedy, on
CPU with one torch thread, alternates per round between four variants (`interleave`): 64 and 512 new
tokens, with the model's cache (`cached`) and through a wrapper without one (`window`: the whole window
through the model at every token, what sampling cost before the cache and what nanoGPT's sample.py does).

Rows: the cache's speed-up at 64 and at 512 tokens (it grows with the length: the window's cost per token
grows with it, the cache's does not), and the cached tokens/s at 512 against at 64 (about 1: the time per
token stays flat). Timed in process CPU time. Run: `python -m bench.sampling [--quick] [--json FILE]`
(`--quick`: one round, checks that it runs).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from bench.harness import Row, bench_main, interleave, paired_ratio_row, quiet
from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.sampling import SampleSettings, sample_tokens

SHAPE = ModelConfig(context=1024, n_layer=4, n_head=4, d_model=128)
PROMPT = torch.tensor(list(b"ROMEO:\n "))
LENGTHS = (64, 512)


class _Window(nn.Module):
    """The model without `new_kv_cache`: the sampler recomputes the window for every token."""

    def __init__(self, model: TinyGPT) -> None:
        super().__init__()
        self.inner, self.cfg = model, model.cfg

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids)


def _variant(model: nn.Module, new_tokens: int):
    settings = SampleSettings(max_new_tokens=new_tokens, temperature=0.0)

    def sample() -> int:
        return sum(1 for _ in sample_tokens(model, PROMPT, settings))

    return sample


def run(quick: bool = False) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = TinyGPT(SHAPE).eval()
        window = _Window(model)
        variants = {}
        for length in LENGTHS:
            variants[f"cached{length}"] = _variant(model, length)
            variants[f"window{length}"] = _variant(window, length)
        timing = interleave(variants, repeats=1 if quick else 5, warmup=0 if quick else 1, clock=time.process_time)
    finally:
        torch.set_num_threads(threads)
    size = "tiny GPT 4x128, context 1024, CPU, 1 thread, greedy"
    rows = [
        paired_ratio_row(
            f"sampling {length} new tokens: KV cache vs recomputing the window ({size})", timing,
            f"cached{length}", f"window{length}", goal_ratio=None, unit="tokens/s", rate=1.0,
            higher_is_better=True, note="tokens/s with the cache / without it; the window's cost per token "
            "grows with the length, the cache's does not.",
        )
        for length in LENGTHS
    ]  # fmt: skip
    rows.append(
        paired_ratio_row(
            f"KV-cached sampling: tokens/s at 512 vs at 64 new tokens ({size})", timing, "cached512", "cached64",
            goal_ratio=None, unit="tokens/s", rate=1.0, higher_is_better=True,
            note="about 1: the time per token stays flat with the length (attention over the cached keys is "
            "a small part of a token's forward at this size).",
        )
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    quiet()
    bench_main(run, "Sampling with the KV cache", __doc__.splitlines()[0])
