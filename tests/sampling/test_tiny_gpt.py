"""Sampling the tiny GPT (fntrain.sampling.decode) and its KV cache (fntrain.models.gpt.KVCache): the
cache changes the cost, not the tokens; a row's tokens depend on its prompt and its own generator only, not
on its batch mates; the window slides past the context; the settings' rules name the field."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.sampling import SampleSettings, decode, pick_tokens, row_generator, sample_tokens

PROMPT = torch.tensor(list(b"ROMEO:"))


def large_weight_gpt(context: int = 16, **shape) -> TinyGPT:
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
    model = large_weight_gpt(experts=experts)
    tokens = list(sample_tokens(model, PROMPT, greedy(24)))
    assert tokens == without_cache(model, PROMPT, 24)
    assert len(set(tokens)) > 3  # a continuation that varies, so the comparison means something


def test_the_cache_gives_the_logits_of_the_full_forward_fed_in_chunks():
    model = large_weight_gpt()
    ids = torch.tensor([list(b"to be or not to")])
    cache = model.new_kv_cache()
    chunks = [model(ids[:, :5], kv_cache=cache), model(ids[:, 5:9], kv_cache=cache)]  # prefill, then a chunk
    chunks += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(9, ids.size(1))]
    torch.testing.assert_close(torch.cat(chunks, 1), model(ids), atol=1e-5, rtol=1e-5)
    assert cache.length == ids.size(1)
    with pytest.raises(ValueError, match="KV cache holds 16 positions"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others():
    model, settings = large_weight_gpt(), SampleSettings(max_new_tokens=16, temperature=1.0)
    draw = lambda seed: list(sample_tokens(model, PROMPT, settings, torch.Generator().manual_seed(seed)))  # noqa: E731
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_draws_from_the_generator_only():
    model = large_weight_gpt()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    list(sample_tokens(model, PROMPT, SampleSettings(max_new_tokens=10, top_p=0.9), torch.Generator().manual_seed(1)))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.is_grad_enabled()  # no_grad is per forward: nothing leaks into the caller


def test_top_k_one_and_a_tiny_nucleus_are_greedy():
    model = large_weight_gpt()
    expected = list(sample_tokens(model, PROMPT, greedy(20)))
    for settings in (SampleSettings(max_new_tokens=20, top_k=1), SampleSettings(max_new_tokens=20, top_p=1e-6)):
        assert list(sample_tokens(model, PROMPT, settings, torch.Generator().manual_seed(5))) == expected


def test_eos_is_yielded_then_the_stream_ends():
    model = large_weight_gpt()
    tokens = list(sample_tokens(model, PROMPT, greedy(30)))
    eos = tokens[4]
    assert list(sample_tokens(model, PROMPT, greedy(30, eos_id=eos))) == tokens[: tokens.index(eos) + 1]


def test_a_prompt_longer_than_the_context_keeps_its_last_context_tokens():
    model = large_weight_gpt()
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

    model = large_weight_gpt()
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
        (SampleSettings(eos_id=(2, -1)), "sample.eos_id must contain integers >= 0, got [2, -1]"),
        (SampleSettings(eos_id=()), "sample.eos_id must name at least one id (or be None), got ()"),
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
        next(sample_tokens(large_weight_gpt(), torch.tensor([], dtype=torch.long), greedy(3)))


def test_a_model_with_compiled_blocks_is_sampled_eagerly_without_recompiling():
    from torch._dynamo.utils import counters

    model = large_weight_gpt()
    expected = list(sample_tokens(model, PROMPT, greedy(12)))
    for block in model.blocks:
        block.compile(backend="eager")  # what --parallel.compile does, in place
    counters.clear()
    assert list(sample_tokens(model, PROMPT, greedy(12))) == expected
    assert not counters["stats"]  # nothing traced: one graph per cache length would hit the recompile limit


# ----------------------------------------------------------------------------- batches: one generator per row

PROMPTS = [list(b"ROMEO:"), list(b"O"), list(b"To be, or not"), list(b"JULIET: ay me")]


def sample_by_hand(model: TinyGPT, prompt: list[int], settings: SampleSettings, generator: torch.Generator) -> list[int]:
    """One row as nanoGPT samples it: its last `context` tokens through the model every step (no cache,
    no padding, positions from 0), the token picked with one uniform drawn from the row's generator."""
    ids = list(prompt)
    for _ in range(settings.max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids[-model.cfg.context :]]))[:, -1]
        ids.append(int(pick_tokens(logits, settings, torch.rand((), generator=generator)[None])))
    return ids[len(prompt) :]


@pytest.mark.parametrize("context", [16, 64], ids=["window-slides", "cache-holds"])
def test_a_rows_tokens_do_not_depend_on_its_batch_mates_their_order_or_number(context):
    model = large_weight_gpt(context)
    settings = SampleSettings(max_new_tokens=20, temperature=1.0, top_k=50)

    def draw(rows: list[int], seed: int) -> list[list[int]]:
        generators = [row_generator(seed, row) for row in rows]
        return decode(model, [PROMPTS[row] for row in rows], settings, generators).tokens

    for seed in (0, 1, 2):
        alone = [draw([row], seed)[0] for row in range(len(PROMPTS))]
        assert draw([0, 1, 2, 3], seed) == alone
        assert draw([3, 1, 0, 2], seed) == [alone[row] for row in (3, 1, 0, 2)]
        assert draw([2, 0], seed) == [alone[2], alone[0]]
        assert draw([1, 1, 3], seed) == [alone[1], alone[1], alone[3]]
        assert len({tuple(tokens) for tokens in alone}) == len(PROMPTS)  # rows that differ: the test can fail


def test_a_long_generation_slides_the_window_as_a_loop_by_hand_does():
    model = large_weight_gpt()  # 16 positions: every row passes the context within its 40 new tokens
    settings = SampleSettings(max_new_tokens=40, temperature=0.9, top_p=0.95)
    for seed in range(3):
        decoded = decode(model, PROMPTS, settings, [row_generator(seed, row) for row in range(len(PROMPTS))])
        expected = [sample_by_hand(model, prompt, settings, row_generator(seed, row)) for row, prompt in enumerate(PROMPTS)]
        assert decoded.tokens == expected


def test_batched_greedy_is_the_argmax_of_each_rows_plain_forward():
    model = large_weight_gpt()
    decoded = decode(model, PROMPTS, greedy(20), [None] * len(PROMPTS))
    assert decoded.tokens == [without_cache(model, torch.tensor(prompt), 20) for prompt in PROMPTS]


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_the_cache_changes_the_cost_not_the_tokens_of_a_batch(experts):
    model, settings = large_weight_gpt(experts=experts), SampleSettings(max_new_tokens=24, temperature=1.0)
    for seed in (3, 4):
        cached, recomputed = (
            decode(model, PROMPTS, settings, [row_generator(seed, row) for row in range(len(PROMPTS))], kv_cache=cache)
            for cache in (True, False)
        )
        assert cached.tokens == recomputed.tokens


def test_a_left_padded_rows_logits_are_its_logits_alone():
    model = large_weight_gpt(32)
    short, long, fed = list(b"hi"), list(b"ROMEO: and"), [5, 7, 9]
    ids = torch.tensor([[0] * (len(long) - len(short)) + short, long])
    real = torch.tensor([[0] * (len(long) - len(short)) + [1] * len(short), [1] * len(long)])
    positions = (real.cumsum(-1) - 1).clamp(min=0)  # each row's first real token at position 0
    cache = model.new_kv_cache()
    with torch.no_grad():
        batch = [model(ids, position_ids=positions, attention_mask=real, kv_cache=cache)[:, -1]]
        for token in fed:  # then one token per row, each at its row's next position
            positions = positions[:, -1:] + 1
            step = torch.full((2, 1), token)
            batch.append(model(step, position_ids=positions, attention_mask=torch.ones_like(step), kv_cache=cache)[:, -1])
        for row, prompt in enumerate((short, long)):
            alone = [model(torch.tensor([prompt + fed[:count]]))[0, -1] for count in range(len(fed) + 1)]
            for padded, unpadded in zip(batch, alone, strict=True):
                torch.testing.assert_close(padded[row], unpadded, atol=1e-5, rtol=1e-5)
    assert cache.valid is not None and cache.valid[0, : len(long) - len(short)].sum() == 0


def test_rows_stop_at_their_eos_and_say_whether_they_were_cut_short():
    model = large_weight_gpt()
    plain = decode(model, PROMPTS, greedy(12), [None] * len(PROMPTS))
    assert plain.truncated == [True] * len(PROMPTS) and all(len(tokens) == 12 for tokens in plain.tokens)
    eos = (plain.tokens[0][3], plain.tokens[2][5])  # several EOS ids: whichever comes first stops a row
    decoded = decode(model, PROMPTS, greedy(12, eos_id=eos), [None] * len(PROMPTS))
    for row, tokens in enumerate(plain.tokens):
        stop = next((index for index, token in enumerate(tokens) if token in eos), None)
        assert decoded.tokens[row] == (tokens if stop is None else tokens[: stop + 1])
        assert decoded.truncated[row] == (stop is None)
    assert decoded.truncated[0] is False and decoded.truncated[2] is False


def test_keep_going_is_asked_before_every_forward_after_the_first_and_obeyed():
    model, asked = large_weight_gpt(), []

    def three_steps(unfinished: bool) -> bool:
        asked.append(unfinished)
        return len(asked) < 3

    decoded = decode(model, PROMPTS[:2], greedy(10), [None, None], keep_going=three_steps)
    assert [len(tokens) for tokens in decoded.tokens] == [3, 3] and decoded.truncated == [True, True]
    assert asked == [True, True, True]


def test_a_finished_row_decodes_on_while_keep_going_says_so_and_adds_nothing():
    # Under FSDP2 a rank whose rows are done keeps running forwards while another rank's are not.
    model = large_weight_gpt()
    (tokens,) = decode(model, [PROMPTS[0]], greedy(12), [None]).tokens
    eos = tokens[2]
    stop = tokens.index(eos) + 1
    steps, asked = [], []
    decoded = decode(model, [PROMPTS[0]], greedy(12, eos_id=eos), [None], on_tokens=steps.append,
                     keep_going=lambda unfinished: asked.append(unfinished) or True)  # fmt: skip
    assert decoded.tokens == [tokens[:stop]] and decoded.truncated == [False]
    assert len(steps) == 12 and steps[:stop] == [[token] for token in tokens[:stop]] and steps[stop:] == [[None]] * (12 - stop)
    assert asked == [True] * (stop - 1) + [False] * (12 - stop)
    alone: list = []
    decode(model, [PROMPTS[0]], greedy(12, eos_id=eos), [None], on_tokens=alone.append)  # the default: stop
    assert alone == steps[:stop]
    sampled = SampleSettings(max_new_tokens=12, temperature=1.0, eos_id=eos)  # no row left to draw for
    (drawn,) = decode(model, [PROMPTS[0]], sampled, [row_generator(0)], keep_going=lambda _: True).tokens
    assert drawn[-1] == eos and len(drawn) < 12  # stopped early, then 10 forwards with nothing to draw


def test_decode_refuses_what_it_cannot_decode():
    model = large_weight_gpt()
    with pytest.raises(ValueError, match="one generator per prompt: 2 prompts, 1 generators"):
        decode(model, PROMPTS[:2], greedy(3), [None])
    with pytest.raises(ValueError, match=r"prompts \[1\] have no tokens"):
        decode(model, [[1], []], greedy(3), [None, None])
    with pytest.raises(ValueError, match="at least one prompt"):
        decode(model, [], greedy(3), [])
