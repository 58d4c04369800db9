"""bench/dpo.py in quick mode on a tinier Llama: every variant runs a round, the hand-written DPO loss is
fntrain's (measure checks it), the frozen copy holds exactly one more model's weights, and run() gives the
five rows. Slow tier: it builds Hugging Face models."""

from __future__ import annotations

import pytest

from bench import dpo
from bench.harness import format_table

pytestmark = pytest.mark.slow

TINY = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def test_quick_run_measures_every_variant_and_gives_five_rows(monkeypatch):
    monkeypatch.setattr(dpo, "SHAPE", TINY)
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
