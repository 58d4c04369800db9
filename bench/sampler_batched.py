"""The batched sampler (fntrain.sampling.decode) on a transformers model: tokens/s against transformers'
own `generate`, and against the same sampler recomputing every step without the KV cache.

The model is a Llama built here from a config (nothing is downloaded: 4 layers, hidden 256, vocabulary
2048, about 4.2 M parameters, float32, no EOS id). The batch is 16 prompts of 8 to 38 random tokens
(left-padded), 64 new tokens each, greedy, so every variant produces the same 1024 tokens per round.
Three variants, one decode of the whole batch each per round, alternated by `interleave` (paired rounds,
process CPU time, one torch thread):

- **decode**: `decode(model, prompts, SampleSettings(max_new_tokens=64, temperature=0), [None] * 16)`:
  fntrain's loop over the model's cache, one token per row per step, per-row positions;
- **generate**: `model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=64)` on the
  same left-padded batch;
- **recompute**: `decode(..., kv_cache=False)`: the whole padded batch through the model every step.

After the rounds the three must give the same tokens (greedy; checked). GRPO's rollout samples (one
uniform per row per step from the row's own generator) where this measures greedy: the draw is a softmax,
a cumulative sum and a search over the vocabulary per row, next to a forward of the whole model.

Run: `python -m bench.sampler_batched [--quick] [--json FILE]` (`--quick`: one round of 8 new tokens,
checks that it runs; a full run is 16 rounds, about 3 min on 2 cores).
"""

from __future__ import annotations

import time

import torch

from bench.harness import Row, bench_main, interleave, paired_ratio_row, quiet
from fntrain.sampling import SampleSettings, decode

SHAPE = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=256,
)  # fmt: skip
ROWS, SHORTEST, LONGEST, NEW_TOKENS = 16, 8, 38, 64
WHERE = f"Llama 4x256, vocab 2048, batch {ROWS}, prompts {SHORTEST}-{LONGEST} tokens, greedy, CPU 1 thread"


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.linspace(SHORTEST, LONGEST, ROWS).round().long().tolist()
    return [torch.randint(1, SHAPE["vocab_size"], (length,), generator=generator).tolist() for length in lengths]


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt in prompts])
    mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    return ids, mask


def _variants(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, out: dict) -> dict:
    """The three variants; each keeps its last tokens in `out` for the check after the rounds."""
    settings = SampleSettings(max_new_tokens=new_tokens, temperature=0)
    ids, mask = _left_padded(prompts)

    def sampler(kv_cache: bool, name: str):
        def run() -> int:
            out[name] = decode(model, prompts, settings, [None] * len(prompts), kv_cache=kv_cache).tokens
            return 1

        return run

    def generate() -> int:
        with torch.no_grad():
            output = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens)
        out["generate"] = output[:, ids.size(1) :].tolist()
        return 1

    return {"decode": sampler(True, "decode"), "generate": generate, "recompute": sampler(False, "recompute")}


def run(quick: bool = False) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    new_tokens = 8 if quick else NEW_TOKENS
    tokens: dict[str, list[list[int]]] = {}
    try:
        variants = _variants(_model(), _prompts(), new_tokens, tokens)
        timing = interleave(variants, repeats=1 if quick else 16, warmup=0 if quick else 1, clock=time.process_time)
    finally:
        torch.set_num_threads(threads)
    if not tokens["decode"] == tokens["generate"] == tokens["recompute"]:
        raise AssertionError("the batched sampler, generate and the recomputing sampler gave different greedy tokens")
    rate = float(ROWS * new_tokens)
    where = f"{WHERE}, {new_tokens} new tokens"
    return [
        paired_ratio_row(
            f"batched sampler vs transformers generate ({where})", timing, "decode", "generate", goal_ratio=None,
            unit="tokens/s", rate=rate, higher_is_better=True,
            note="tokens/s of fntrain.sampling.decode / of model.generate, the same greedy tokens.",
        ),
        paired_ratio_row(
            f"batched sampler: KV cache vs recomputing every step ({where})", timing, "decode", "recompute",
            goal_ratio=None, unit="tokens/s", rate=rate, higher_is_better=True,
            note="tokens/s with the model's cache / with the whole padded batch through the model every step.",
        ),
    ]  # fmt: skip


if __name__ == "__main__":
    quiet()
    bench_main(run, "The batched sampler against generate", __doc__.splitlines()[0])
