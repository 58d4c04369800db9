"""Pins of fntrain/sampling/keys.py (tests written to kill a mutant its mutation run left alive)."""

from __future__ import annotations

import torch

from fntrain.sampling.keys import row_generator, row_seed


def test_a_rows_stream_depends_on_the_runs_seed_as_well_as_on_its_key():
    first, second = row_generator(1, 0, 2, 3), row_generator(2, 0, 2, 3)
    assert torch.rand(4, generator=first).tolist() != torch.rand(4, generator=second).tolist()
    assert row_generator(7, 0, 2, 3).initial_seed() == row_seed(7, 0, 2, 3)
