"""fntrain's decode loop over a transformers causal LM's own cache (fntrain.sampling.decode), on a Llama
(rotary positions) and a GPT-2 (learned ones): greedy gives transformers' greedy `generate` tokens; a row's
tokens and logits do not depend on its batch mates; the cache changes the cost, not the tokens; `fntrain
generate` samples HF models with it."""

from __future__ import annotations

import io

import pytest
import torch

from fntrain.sampling import SampleSettings, decode, row_generator

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 9, 250], [40], [7, 7, 8, 100, 101, 102, 103, 104, 3, 60, 61], [90, 91, 92]]


def hf_causal_lm(kind: str):
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        ))  # fmt: skip
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    ))  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def hf_model(request):
    """A 2-layer Llama (rotary positions) or GPT-2 (learned positions: a row's positions must start at 0
    at its first real token) built from a config (vocabulary 300: bytes fit), with weights large enough
    that its distributions are far from uniform; no EOS, so `generate` runs every row to its length."""
    torch.manual_seed(0)
    model = hf_causal_lm(request.param).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    return model


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    output = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens)
    return output[0, len(prompt) :].tolist()


def test_greedy_gives_the_tokens_of_transformers_greedy_generate_alone_and_in_a_batch(hf_model):
    greedy = SampleSettings(max_new_tokens=12, temperature=0)
    expected = [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    assert decode(hf_model, PROMPTS, greedy, [None] * 4).tokens == expected
    assert [decode(hf_model, [prompt], greedy, [None]).tokens[0] for prompt in PROMPTS] == expected
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)


def test_a_rows_tokens_do_not_depend_on_its_batch_mates_their_order_or_number(hf_model):
    settings = SampleSettings(max_new_tokens=16, temperature=1.0, top_p=0.95)

    def draw(rows: list[int], seed: int) -> list[list[int]]:
        generators = [row_generator(seed, row) for row in rows]
        return decode(hf_model, [PROMPTS[row] for row in rows], settings, generators).tokens

    for seed in (0, 1, 2):
        alone = [draw([row], seed)[0] for row in range(len(PROMPTS))]
        assert draw([0, 1, 2, 3], seed) == alone
        assert draw([3, 2, 1, 0], seed) == alone[::-1]
        assert draw([2, 1], seed) == [alone[2], alone[1]]


def test_the_cache_changes_the_cost_not_the_tokens(hf_model):
    settings = SampleSettings(max_new_tokens=16, temperature=1.0)
    cached, recomputed = (
        decode(hf_model, PROMPTS, settings, [row_generator(7, row) for row in range(4)], kv_cache=cache)
        for cache in (True, False)
    )
    assert cached.tokens == recomputed.tokens


class RecordingModel(torch.nn.Module):
    """A transformers causal LM that keeps the last position's logits of every forward."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.logits = model, model.config, []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):  # fmt: skip
        output = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=use_cache, logits_to_keep=logits_to_keep)  # fmt: skip
        self.logits.append(output.logits[:, -1])
        return output


def test_a_left_padded_rows_logits_are_its_logits_alone(hf_model):
    settings = SampleSettings(max_new_tokens=6, temperature=0)
    batch = RecordingModel(hf_model)
    tokens = decode(batch, PROMPTS, settings, [None] * 4).tokens
    for row, prompt in enumerate(PROMPTS):
        alone = RecordingModel(hf_model)
        assert decode(alone, [prompt], settings, [None]).tokens[0] == tokens[row]
        for padded, unpadded in zip(batch.logits, alone.logits, strict=True):
            torch.testing.assert_close(padded[row], unpadded[0], atol=1e-5, rtol=1e-5)


def test_fntrain_generate_samples_an_hf_model_with_the_sampler(hf_model):
    from fntrain.models.generate import GenerateOptions, generate
    from fntrain.models.load import TextAssets

    def sample(seed: int, **options):
        out = io.StringIO()
        torch.manual_seed(seed + 100)  # the global RNG plays no part
        (drawn,) = generate(hf_model, TextAssets(), GenerateOptions(prompt=("hi",), seed=seed, **options), out)
        return drawn, out.getvalue()

    greedy, out = sample(1, temperature=0.0, max_new_tokens=10)
    assert list(greedy.token_ids) == hf_greedy(hf_model, list(b"hi"), 10)
    assert out == "hi" + greedy.text + "\n" or "\ufffd" in out
    first, again, other = sample(3, max_new_tokens=12)[0], sample(3, max_new_tokens=12)[0], sample(4, max_new_tokens=12)[0]
    assert first.token_ids == again.token_ids != other.token_ids
    hf_model.generation_config.eos_token_id = [first.token_ids[4], 299]  # several EOS ids: the first one met stops
    try:
        stopped = sample(3, max_new_tokens=12)[0]
    finally:
        hf_model.generation_config.eos_token_id = None
    stop = next(index for index, token in enumerate(first.token_ids) if token in (first.token_ids[4], 299))
    assert stopped.token_ids == first.token_ids[: stop + 1]
