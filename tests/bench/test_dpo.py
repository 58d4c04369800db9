"""bench/dpo.py in quick mode on a tinier Llama: every variant runs a round, the hand-written DPO loss is
fntrain's (measure checks it), the frozen copy holds exactly one more model's weights, and run() gives the
five rows. Slow tier: it builds Hugging Face models."""

from __future__ import annotations

import pytest

from bench import dpo
from bench.harness import format_table
from tests.helpers.hf import TINY_LLAMA_SHAPE

pytestmark = pytest.mark.slow


def test_quick_run_measures_every_variant_and_gives_five_rows(monkeypatch):
    monkeypatch.setattr(dpo, "SHAPE", TINY_LLAMA_SHAPE)
    measured = dpo.measure(quick=True)
    timing, peaks, weights, loss = measured
    names = {"fntrain", "hand-written", "adapter-off", "copy"}
    assert set(timing.samples) == names
    assert all(len(values) == 1 and values[0] > 0 for values in timing.samples.values())
    assert loss > 0
    base = sum(t.numel() * t.element_size() for t in (*dpo._base().parameters(), *dpo._base().buffers()))
    assert weights["copy"] - weights["adapter-off"] == base
    assert peaks["adapter-off"] < peaks["copy"]
    assert all(peaks[name] > weights[name] for name in names)

    monkeypatch.setattr(dpo, "measure", lambda quick: measured)
    rows = dpo.run(quick=True)
    assert len(rows) == 5
    assert [row.rounds for row in rows if row.interval] == [1, 1]
    assert "DPO with LoRA, weights held" in format_table(rows)
