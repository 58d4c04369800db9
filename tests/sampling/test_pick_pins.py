"""Pins of fntrain/sampling/pick.py (tests written to kill mutants its mutation run left alive)."""

from __future__ import annotations

import torch

from fntrain.sampling.keys import row_generator
from fntrain.sampling.pick import cut_scores, draw_uniforms, pick_tokens
from fntrain.sampling.settings import SampleSettings


def test_a_token_is_dropped_once_the_more_likely_ones_hold_exactly_top_p():
    # Two tokens of probability 0.5 exactly: with top_p 0.5 the first already holds it, so the second goes.
    scores = cut_scores(torch.zeros(1, 2), SampleSettings(top_p=0.5))
    assert scores.tolist() == [[0.0, float("-inf")]]


def test_a_draw_at_zero_skips_the_tokens_cut_to_probability_zero():
    # Token 0 is cut (top_k 1 keeps token 1): a uniform of 0 must still land on a token that can be drawn.
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert pick_tokens(logits, SampleSettings(top_k=1), torch.zeros(1)).tolist() == [1]


def test_uniforms_of_another_dtype_pick_the_same_tokens():
    logits = torch.tensor([[0.3, 1.0, -0.5, 2.0], [1.5, 0.0, 0.2, 0.1]])
    uniforms = torch.tensor([0.37, 0.81])
    settings = SampleSettings(temperature=0.7)
    assert pick_tokens(logits, settings, uniforms.double()).tolist() == pick_tokens(logits, settings, uniforms).tolist()


def test_uniforms_are_moved_to_the_device_asked_for_and_stay_put_otherwise():
    generators = [row_generator(0, row) for row in range(3)]
    assert draw_uniforms(generators, device="meta").device.type == "meta"
    assert draw_uniforms([row_generator(0, row) for row in range(3)]).device.type == "cpu"


def test_a_top_p_of_one_cuts_nothing_even_when_the_head_holds_all_float32_can_show():
    scores = cut_scores(torch.tensor([[100.0, 0.0, 0.0]]), SampleSettings(top_p=1.0))
    assert torch.isfinite(scores).all()
