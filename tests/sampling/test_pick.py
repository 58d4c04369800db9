"""Picking the next token of each row (fntrain.sampling.pick): greedy is the argmax, top-k and top-p cut
what they say, and a draw is the inverse CDF of the cut distribution at the row's own uniform."""

from __future__ import annotations

import pytest
import torch

from fntrain.sampling import SampleSettings, cut_scores, draw_uniforms, pick_tokens

# Probabilities about 0.66, 0.24, 0.09, 0.0006, 0.0002 at temperature 1.
LOGITS = torch.tensor([4.0, 3.0, 2.0, -5.0, -6.0])


def drawn(settings: SampleSettings, draws: int = 200) -> set[int]:
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0))
    return set(pick_tokens(LOGITS.expand(draws, -1), settings, uniforms).tolist())


def test_temperature_zero_is_the_argmax_of_each_row_whatever_the_cuts():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    for settings in (SampleSettings(temperature=0), SampleSettings(temperature=0, top_k=3, top_p=0.2)):
        assert torch.equal(pick_tokens(logits, settings, None), logits.argmax(-1))


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    assert drawn(SampleSettings()) >= {0, 1, 2}  # no cut: the likely tokens all come up
    assert drawn(SampleSettings(top_k=2)) == {0, 1}
    assert drawn(SampleSettings(top_p=0.8)) == {0, 1}  # 0.66 < 0.8: the second token completes the nucleus
    assert drawn(SampleSettings(top_p=0.5)) == {0}  # the most likely token always stays
    assert drawn(SampleSettings(top_k=3, top_p=0.95)) == {0, 1, 2}


def test_the_cut_scores_are_minus_infinity_outside_and_tempered_inside():
    scores = cut_scores(LOGITS[None], SampleSettings(temperature=2.0, top_k=3))
    assert torch.equal(scores[0, :3], LOGITS[:3] / 2) and torch.isinf(scores[0, 3:]).all()
    nucleus = cut_scores(torch.stack([LOGITS, LOGITS.flip(0)]), SampleSettings(top_p=0.8))
    assert torch.isfinite(nucleus).tolist() == [[True, True, False, False, False], [False, False, False, True, True]]


def test_a_draw_is_the_inverse_cdf_at_the_rows_uniform():
    probs = torch.softmax(LOGITS, -1)
    edges = probs.cumsum(-1).tolist()  # about 0.665, 0.910, 0.9994, 0.9998, 1
    uniforms = torch.tensor([0.0, edges[0] - 1e-4, edges[0] + 1e-4, edges[1] + 1e-4, edges[2] + 1e-5, 0.999999])
    picked = pick_tokens(LOGITS.expand(len(uniforms), -1), SampleSettings(), uniforms)
    assert picked.tolist() == [0, 0, 1, 2, 3, 4]
    # Rows are independent: each row's token is decided by its own uniform and logits only.
    mixed = torch.stack([LOGITS, LOGITS.flip(0)])
    assert pick_tokens(mixed, SampleSettings(), torch.tensor([0.5, 0.5])).tolist() == [0, 4]


def test_a_cut_token_is_never_drawn_even_at_the_top_of_the_interval():
    uniforms = torch.tensor([1.0 - 2**-24] * 3)  # the largest float32 below 1
    settings = (SampleSettings(top_k=2), SampleSettings(top_p=0.5), SampleSettings(top_k=1))
    assert [int(pick_tokens(LOGITS[None], s, uniforms[:1])) for s in settings] == [1, 0, 0]


def test_uniforms_come_one_from_each_generator_as_a_scalar_draw_would():
    generators = [torch.Generator().manual_seed(seed) for seed in (4, 5, 4)]
    uniforms = draw_uniforms(generators)
    expected = [torch.rand((), generator=torch.Generator().manual_seed(seed)).item() for seed in (4, 5, 4)]
    assert uniforms.dtype == torch.float32 and uniforms.tolist() == expected
    assert draw_uniforms(generators[:1]).item() != expected[0]  # each generator advanced by one draw
    assert draw_uniforms([]).shape == (0,)


def test_sampling_without_uniforms_or_with_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"needs one uniform per row \(2\), got None"):
        pick_tokens(torch.zeros(2, 5), SampleSettings(), None)
    with pytest.raises(ValueError, match=r"needs one uniform per row \(2\), got \(3,\)"):
        pick_tokens(torch.zeros(2, 5), SampleSettings(), torch.zeros(3))
    with pytest.raises(ValueError, match=r"logits must be \[rows, vocab\], got shape \(5,\)"):
        pick_tokens(torch.zeros(5), SampleSettings(), torch.zeros(1))
