"""bench/grpo.py in quick mode on a tinier Llama: every variant (fntrain's and TRL's train, score and
generate) runs a round on the same rows, both sides' completions run to their full length (measure checks
it), the recipe's time split covers its steps, and run() gives the seven rows. Slow tier: it builds Hugging
Face models and a TRL trainer and runs the grpo recipe."""

from __future__ import annotations

import pytest

from bench import grpo
from bench.harness import format_table
from tests.helpers.hf import TINY_LLAMA_SHAPE

pytestmark = pytest.mark.slow


def test_quick_run_measures_every_variant_and_gives_seven_rows(monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.setattr(grpo, "SHAPE", TINY_LLAMA_SHAPE)
    measured = grpo.measure(quick=True)
    timing, split, facts = measured
    sides = ("fntrain", "TRL")
    assert set(timing.samples) == {f"{side} {part}" for side in sides
                                   for part in ("train", "score", "generate")}  # fmt: skip
    assert all(len(values) == 1 and values[0] > 0 for values in timing.samples.values())
    rows = grpo.PROMPTS * grpo.GENERATIONS
    assert [sum(count for count, _ in facts["shapes"][side]) for side in sides] == [rows, rows]  # every row
    assert set(split.samples) == {*grpo.SPLIT, "step"}
    assert len(split.samples["step"]) == 2  # quick runs 3 steps; the first is left out
    for index, step in enumerate(split.samples["step"]):
        assert step == pytest.approx(sum(split.samples[name][index] for name in grpo.SPLIT)) and step > 0

    monkeypatch.setattr(grpo, "measure", lambda quick: measured)
    table = grpo.run(quick=True)
    assert len(table) == 7 and all(row.rounds for row in table)
    assert "time/generation_s / the step" in format_table(table)
