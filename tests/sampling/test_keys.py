"""One random stream per row, named by integers (fntrain.sampling.keys): the same key gives the same
stream and the same tokens, another key another stream; the seed of a key never changes."""

from __future__ import annotations

import pytest
import torch

from fntrain.models.gpt import ModelConfig, TinyGPT
from fntrain.sampling import SampleSettings, decode, row_generator, row_seed


def test_the_same_key_gives_the_same_stream_and_another_key_another():
    first = torch.rand(8, generator=row_generator(1, 2, 3, 4))
    assert torch.equal(first, torch.rand(8, generator=row_generator(1, 2, 3, 4)))
    others = [(1, 2, 3, 5), (1, 2, 4, 3), (2, 1, 3, 4), (1, 2, 3), (1, 2, 3, 4, 0)]
    assert all(not torch.equal(first, torch.rand(8, generator=row_generator(*key))) for key in others)
    assert len({row_seed(1, generation, prompt) for generation in range(30) for prompt in range(30)}) == 900


def test_a_keys_seed_is_pinned_and_fits_in_63_bits():
    # A resumed run regenerates its rollouts from these seeds: the hash must never change.
    assert row_seed(0) == 1513784181294443541
    assert row_seed(1234, 7, 42, 3) == 1089001277896429084
    assert 0 <= row_seed(-(2**100), 2**100) < 2**63
    assert row_generator(5, 6).device == torch.device("cpu")


def test_keys_name_rows_of_a_decode_the_same_key_the_same_tokens():
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(context=32, n_layer=1, n_head=2, d_model=16)).eval()
    settings = SampleSettings(max_new_tokens=16, temperature=1.0)
    tokens = lambda *key: decode(model, [list(b"ab")], settings, [row_generator(*key)]).tokens[0]  # noqa: E731
    assert tokens(9, 0, 1) == tokens(9, 0, 1)
    assert tokens(9, 0, 1) != tokens(9, 0, 2)


def test_a_key_that_is_not_an_int_is_refused_naming_its_place():
    with pytest.raises(TypeError, match=r"^key\[1\] must be an int, got 2.0"):
        row_seed(1, 0, 2.0)
    with pytest.raises(TypeError, match=r"^seed must be an int, got True"):
        row_seed(True)
