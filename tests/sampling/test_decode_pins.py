"""Pins of fntrain/sampling/decode.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from fntrain.sampling import SampleSettings, decode, sample_tokens
from tests.sampling.test_tiny_gpt import PROMPT, greedy, large_weight_gpt

VOCAB = 11
PROMPTS = [[5, 3, 9], [4], [7, 7, 8, 1, 2], [6, 2]]


def running_sum_tokens(prompt: list[int], steps: int) -> list[int]:
    """What the models below write greedily: each new token is the sum of every token so far, mod VOCAB."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(sum(ids) % VOCAB)
    return ids[len(prompt) :]


class RunningSumLM(nn.Module):
    """A causal LM with a transformers model's interface whose most likely next token is the sum of the
    tokens so far mod VOCAB (padding is id 0: it adds nothing); its cache is each row's running sum. It
    records each forward's columns and keywords."""

    def __init__(self, context: int | None = 64) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(max_position_embeddings=context)
        self.calls: list[tuple[int, dict]] = []

    def _run(self, input_ids, cache, use_cache, **keywords):
        self.calls.append((input_ids.shape[1], keywords))
        before = cache if cache is not None else torch.zeros(input_ids.shape[0], dtype=torch.long)
        sums = before[:, None] + input_ids.cumsum(-1)
        logits = 5.0 * nn.functional.one_hot(sums % VOCAB, VOCAB).float()
        return logits, (sums[:, -1] if use_cache else None)


class OldInterfaceLM(RunningSumLM):
    """transformers before 5.25: the cache is `past_key_values`, and no `logits_to_keep`."""

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None
    ):
        logits, cache = self._run(input_ids, past_key_values, use_cache, masked=attention_mask is not None)
        return types.SimpleNamespace(logits=logits, past_key_values=cache)


class NewInterfaceLM(RunningSumLM):
    """transformers 5.25 on: the cache is `cache`, and `logits_to_keep` computes the last positions only; a
    VLM's `pixel_values` are recorded."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, cache=None,
                logits_to_keep=0, pixel_values=None):  # fmt: skip
        logits, new_cache = self._run(input_ids, cache, use_cache, logits_to_keep=logits_to_keep,
                                      masked=attention_mask is not None, pixels=pixel_values is not None)  # fmt: skip
        return types.SimpleNamespace(logits=logits[:, -logits_to_keep:], cache=new_cache)


class PeftLikeWrapper(nn.Module):
    """What peft's PeftModel offers the decode loop: forward(*args, **kwargs) passed on, and get_base_model()."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base, self.config = base, base.config

    def get_base_model(self) -> nn.Module:
        return self.base

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)


def test_a_transformers_model_of_either_cache_interface_decodes_through_its_cache():
    """Greedy tokens are the model's whatever its cache keyword; after the prompt each forward feeds one
    column per row (the cache is used), and without the cache every forward recomputes all columns."""
    for model_class in (OldInterfaceLM, NewInterfaceLM):
        model = model_class()
        decoded = decode(model, PROMPTS, greedy(6), [None] * len(PROMPTS))
        assert decoded.tokens == [running_sum_tokens(prompt, 6) for prompt in PROMPTS], model_class.__name__
        assert [columns for columns, _ in model.calls] == [5, 1, 1, 1, 1, 1]
        again = model_class()
        assert (
            decode(again, PROMPTS, greedy(6), [None] * len(PROMPTS), kv_cache=False).tokens == decoded.tokens
        )
        assert [columns for columns, _ in again.calls] == [5, 6, 7, 8, 9, 10]


def test_a_transformers_model_that_can_keep_the_last_logits_computes_only_those():
    model = NewInterfaceLM()
    decode(model, PROMPTS, greedy(4), [None] * len(PROMPTS))
    assert [keywords["logits_to_keep"] for _, keywords in model.calls] == [1] * 4


def test_a_peft_wrapped_transformers_model_decodes_as_its_base_model():
    """The wrapper's forward takes **kwargs: the cache keyword and logits_to_keep are read off its base."""
    base = NewInterfaceLM()
    decoded = decode(PeftLikeWrapper(base), PROMPTS, greedy(4), [None] * len(PROMPTS))
    assert decoded.tokens == [running_sum_tokens(prompt, 4) for prompt in PROMPTS]
    assert [(columns, keywords["logits_to_keep"]) for columns, keywords in base.calls] == [
        (5, 1),
        (1, 1),
        (1, 1),
        (1, 1),
    ]


def test_a_transformers_model_gets_a_mask_only_when_a_row_is_padded():
    """As `generate` does: one prompt (or prompts of one length) without a mask, a padded batch with one."""
    for prompts, masked in (([[5, 3, 9]], False), ([[5, 3, 9], [1, 2, 4]], False), (PROMPTS, True)):
        for model in (OldInterfaceLM(), NewInterfaceLM()):
            decode(model, prompts, greedy(3), [None] * len(prompts))
            assert [keywords["masked"] for _, keywords in model.calls] == [masked] * 3, (prompts, model)


def test_prefill_inputs_go_to_the_first_forward_or_with_no_cache_to_every_forward():
    pixels = {"pixel_values": torch.zeros(len(PROMPTS), 3, 2, 2)}
    cached = NewInterfaceLM()
    decode(cached, PROMPTS, greedy(3), [None] * len(PROMPTS), prefill_inputs=pixels)
    assert [keywords["pixels"] for _, keywords in cached.calls] == [True, False, False]
    recomputed = NewInterfaceLM()
    decode(recomputed, PROMPTS, greedy(3), [None] * len(PROMPTS), kv_cache=False, prefill_inputs=pixels)
    assert [keywords["pixels"] for _, keywords in recomputed.calls] == [True, True, True]


def test_sample_tokens_decodes_the_tiny_gpt_through_its_cache_unmasked():
    """After the prompt, each streamed token costs a forward of one column; one row has no padding, so no
    forward gets a mask or positions (the model's own causal path)."""
    model = large_weight_gpt(context=64)
    calls: list[tuple] = []

    def record(module, args, kwargs):
        calls.append(
            (args[0].shape[1], kwargs.get("attention_mask") is None, kwargs.get("position_ids") is None)
        )

    model.register_forward_pre_hook(record, with_kwargs=True)
    assert len(list(sample_tokens(model, PROMPT, greedy(5)))) == 5
    assert calls == [(len(PROMPT), True, True)] + [(1, True, True)] * 4


def test_the_context_a_model_names_is_read_from_its_config():
    """The tiny GPT's cfg.context, a transformers config's max_position_embeddings or GPT-2's n_positions."""
    from fntrain.sampling.decode import model_context

    config = types.SimpleNamespace
    assert model_context(large_weight_gpt(context=24)) == 24
    assert model_context(types.SimpleNamespace(config=config(max_position_embeddings=128))) == 128
    assert model_context(types.SimpleNamespace(config=config(n_positions=64))) == 64
    assert model_context(types.SimpleNamespace(config=config(n_positions=0))) is None
    assert model_context(PlainSumLM()) is None


class PlainSumLM(nn.Module):
    """Any other model: model(input_ids) -> logits of every position, the running sum's token most likely;
    it names no context, so nothing is cut."""

    def forward(self, input_ids):
        return 5.0 * nn.functional.one_hot(input_ids.cumsum(-1) % VOCAB, VOCAB).float()


def test_a_plain_model_without_a_context_decodes_rows_of_different_lengths_each_its_own():
    decoded = decode(PlainSumLM(), PROMPTS, greedy(5), [None] * len(PROMPTS))
    assert decoded.tokens == [running_sum_tokens(prompt, 5) for prompt in PROMPTS]
    sampled = SampleSettings(max_new_tokens=3, temperature=1.0)
    assert len(decode(PlainSumLM(), PROMPTS, sampled, [None] * len(PROMPTS)).tokens[2]) == 3


class DeviceRecordingLM(nn.Module):
    """A transformers-style model whose weights live on the meta device (as if elsewhere): it records the
    device of each forward's inputs and always prefers token 3 (its logits made on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, device="meta"))
        self.config = types.SimpleNamespace(max_position_embeddings=64)
        self.devices: list[tuple] = []

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, use_cache=False, past_key_values=None
    ):
        mask = attention_mask.device.type if attention_mask is not None else None
        self.devices.append((input_ids.device.type, mask, position_ids.device.type))
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], VOCAB)
        logits[..., 3] = 1.0
        return types.SimpleNamespace(logits=logits, past_key_values="its cache")


def test_the_ids_mask_and_positions_go_to_the_device_asked_for_else_the_parameters():
    asked = DeviceRecordingLM()
    assert decode(asked, PROMPTS, greedy(2), [None] * len(PROMPTS), device="cpu").tokens == [[3, 3]] * len(
        PROMPTS
    )
    assert asked.devices == [("cpu", "cpu", "cpu")] * 2
    default = DeviceRecordingLM()
    decode(default, PROMPTS, greedy(2), [None] * len(PROMPTS))
    assert default.devices == [("meta", "meta", "meta")] * 2
    streamed = DeviceRecordingLM()  # sample_tokens: where the prompt is
    assert list(sample_tokens(streamed, torch.tensor([5, 3]), greedy(2))) == [3, 3]
    assert [device for device, _, _ in streamed.devices] == ["cpu", "cpu"]


class CallableModel:
    """A model that is a plain callable, no nn.Module: no parameters to say where it runs (the CPU)."""

    def __call__(self, input_ids):
        return PlainSumLM()(input_ids)


def test_a_model_without_parameters_decodes_on_the_cpu():
    assert decode(CallableModel(), [[5, 3, 9]], greedy(3), [None]).tokens == [
        running_sum_tokens([5, 3, 9], 3)
    ]
    assert decode(PlainSumLM(), [[5, 3, 9]], greedy(3), [None]).tokens == [running_sum_tokens([5, 3, 9], 3)]


def test_rows_without_a_generator_sample_from_fresh_ones_never_the_global_rng():
    model = large_weight_gpt()
    state = torch.get_rng_state()
    for temperature in (1.0, 0.7):
        sampled = SampleSettings(max_new_tokens=4, temperature=temperature)
        decoded = decode(model, [[5, 3, 9], [4]], sampled, [None, None])
        assert [len(tokens) for tokens in decoded.tokens] == [4, 4]
        assert torch.equal(torch.get_rng_state(), state)


def test_no_prompt_at_all_is_refused_in_one_line():
    with pytest.raises(ValueError) as error:
        decode(PlainSumLM(), [], greedy(2), [])
    assert str(error.value) == "decode needs at least one prompt, got none"


def test_a_tiny_gpt_that_also_carries_a_config_is_decoded_through_its_own_cache():
    """A model with `new_kv_cache` is the tiny GPT whatever else it carries (a wrapper may add a `config`)."""
    model = large_weight_gpt(context=64)
    expected = list(sample_tokens(model, PROMPT, greedy(5)))
    model.config = types.SimpleNamespace(max_position_embeddings=64)
    columns: list[int] = []
    model.register_forward_pre_hook(lambda module, args: columns.append(args[0].shape[1]))
    assert list(sample_tokens(model, PROMPT, greedy(5))) == expected
    assert columns == [len(PROMPT), 1, 1, 1, 1]


def test_a_transformers_models_prompt_is_never_cut_to_its_positions():
    """Keeping prompt + new tokens within a transformers model's positions is the caller's: a prompt
    longer than max_position_embeddings goes in whole."""
    prompt = [5, 3, 9, 1, 2, 6]
    model = NewInterfaceLM(context=4)
    assert decode(model, [prompt], greedy(3), [None]).tokens == [running_sum_tokens(prompt, 3)]
    assert model.calls[0][0] == len(prompt)


def test_a_context_of_one_position_is_a_context():
    from fntrain.sampling.decode import model_context

    assert model_context(types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=1))) == 1
