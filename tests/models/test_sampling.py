"""Sampling the tiny GPT (fntrain.models.sampling) and its KV cache (fntrain.models.gpt.KVCache): the
cache changes the cost, not the tokens; the seed decides the draws; the settings' rules name the field."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.models.sampling import SampleSettings, pick_token, sample_tokens

PROMPT = torch.tensor(list(b"ROMEO:"))


def tiny(context: int = 16, **shape) -> TinyGPT:
    """A small GPT with large weights: its greedy continuation varies (GPT-2's 0.02 init repeats one byte)."""
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=context, n_layer=2, n_head=2, d_model=32, **shape)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3)
    return model


def without_cache(model: TinyGPT, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding by hand: the whole (left-truncated) window through the model at every step."""
    ids = prompt.tolist()
    for _ in range(steps):
        window = torch.tensor(ids[-model.cfg.context :])[None]
        with torch.no_grad():
            output = model(window)
        ids.append(int(getattr(output, "logits", output)[0, -1].argmax()))
    return ids[len(prompt) :]


def greedy(steps: int, **settings) -> SampleSettings:
    return SampleSettings(max_new_tokens=steps, temperature=0.0, **settings)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_kv_cached_greedy_tokens_equal_the_full_window_recomputed(experts):
    # 24 new tokens after 6 of prompt with a 16-position context: the cache fills, then the window slides.
    model = tiny(experts=experts)
    tokens = list(sample_tokens(model, PROMPT, greedy(24)))
    assert tokens == without_cache(model, PROMPT, 24)
    assert len(set(tokens)) > 3  # a continuation that varies, so the comparison means something


def test_the_cache_gives_the_logits_of_the_full_forward_fed_in_chunks():
    model = tiny()
    ids = torch.tensor([list(b"to be or not to")])
    cache = model.new_kv_cache()
    chunks = [model(ids[:, :5], kv_cache=cache), model(ids[:, 5:9], kv_cache=cache)]  # prefill, then a chunk
    chunks += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(9, ids.size(1))]
    torch.testing.assert_close(torch.cat(chunks, 1), model(ids), atol=1e-5, rtol=1e-5)
    assert cache.length == ids.size(1)
    with pytest.raises(ValueError, match="KV cache holds 16 positions"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    model, settings = tiny(), SampleSettings(max_new_tokens=16, temperature=1.0)
    draw = lambda seed: list(sample_tokens(model, PROMPT, settings, torch.Generator().manual_seed(seed)))  # noqa: E731
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_draws_from_the_generator_only():
    model = tiny()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    list(sample_tokens(model, PROMPT, SampleSettings(max_new_tokens=10, top_p=0.9), torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.is_grad_enabled()  # no_grad is per forward: nothing leaks into the caller


def test_top_k_one_and_a_tiny_nucleus_are_greedy():
    model = tiny()
    expected = list(sample_tokens(model, PROMPT, greedy(20)))
    for settings in (SampleSettings(max_new_tokens=20, top_k=1), SampleSettings(max_new_tokens=20, top_p=1e-6)):
        assert list(sample_tokens(model, PROMPT, settings, torch.Generator().manual_seed(5))) == expected


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, -5.0, -6.0])  # probabilities about 0.66, 0.24, 0.09, ...
    drawn = lambda settings: {pick_token(logits, settings, torch.Generator().manual_seed(s)) for s in range(200)}  # noqa: E731
    assert drawn(SampleSettings(top_k=2)) == {0, 1}
    assert drawn(SampleSettings(top_p=0.8)) == {0, 1}  # 0.66 < 0.8: the second token completes the nucleus
    assert drawn(SampleSettings(top_p=0.5)) == {0}


def test_eos_is_yielded_then_the_stream_ends():
    model = tiny()
    tokens = list(sample_tokens(model, PROMPT, greedy(30)))
    eos = tokens[4]
    assert list(sample_tokens(model, PROMPT, greedy(30, eos_id=eos))) == tokens[: tokens.index(eos) + 1]


def test_a_prompt_longer_than_the_context_keeps_its_last_context_tokens():
    model = tiny()
    long_prompt = torch.tensor(list(b"a prompt longer than sixteen bytes: ROMEO:"))
    tokens = list(sample_tokens(model, long_prompt, greedy(12)))
    assert tokens == list(sample_tokens(model, long_prompt[-16:], greedy(12)))
    assert tokens == without_cache(model, long_prompt, 12)


def test_a_model_without_a_cache_is_sampled_over_its_window():
    class Plain(nn.Module):  # no new_kv_cache: the sampler recomputes the window every token
        def __init__(self, model):
            super().__init__()
            self.inner, self.cfg = model, model.cfg

        def forward(self, input_ids):
            return self.inner(input_ids)

    model = tiny()
    assert list(sample_tokens(Plain(model), PROMPT, greedy(25))) == list(sample_tokens(model, PROMPT, greedy(25)))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (SampleSettings(top_p=1.5), "sample.top_p must be in (0, 1], got 1.5"),
        (SampleSettings(top_p=0.0), "sample.top_p must be in (0, 1], got 0.0"),
        (SampleSettings(temperature=-1.0), "sample.temperature must be >= 0.0, got -1.0"),
        (SampleSettings(top_k=-2), "sample.top_k must be >= 0, got -2"),
        (SampleSettings(max_new_tokens=0), "sample.max_new_tokens must be >= 1, got 0"),
        (SampleSettings(eos_id=True), "sample.eos_id must be an int, got True"),
    ],
)
def test_settings_errors_name_the_field_and_the_value(settings, message):
    with pytest.raises((ValueError, TypeError)) as error:
        settings.validate()
    assert str(error.value) == message
    with pytest.raises((ValueError, TypeError), match="^generate"):
        settings.validate("generate")


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="non-empty 1-D"):
        next(sample_tokens(tiny(), torch.tensor([], dtype=torch.long), greedy(3)))


def test_a_model_with_compiled_blocks_is_sampled_eagerly_without_recompiling():
    from torch._dynamo.utils import counters

    model = tiny()
    expected = list(sample_tokens(model, PROMPT, greedy(12)))
    for block in model.blocks:
        block.compile(backend="eager")  # what --parallel.compile does, in place
    counters.clear()
    assert list(sample_tokens(model, PROMPT, greedy(12))) == expected
    assert not counters["stats"]  # nothing traced: one graph per cache length would hit the recompile limit
