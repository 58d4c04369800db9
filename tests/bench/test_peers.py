"""bench/peers.py: the data is long-tailed and capped, the counts tell padding from useful tokens, and in
quick mode on a tinier Llama every step variant runs a round (the padded ones on the same tensors on both
sides, measure checks it), both sides' whole runs run as child processes, and rows() gives the table. The
quick run is in the slow tier: it builds Hugging Face models and TRL trainers and starts four processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import peers
from bench.harness import format_table

TINY = dict(
    vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def test_rows_have_long_tailed_lengths_within_the_cap():
    rows = peers._rows("dpo", 400)
    prompts = np.array([len(row["prompt"].split()) for row in rows])
    for answer in ("chosen", "rejected"):
        assert all(row[answer].startswith(" ") for row in rows)  # the prompt's last word stays a word
        totals = prompts + np.array([len(row[answer].split()) for row in rows]) + 1  # + EOS
        assert totals.max() <= peers.MAX_LENGTH
        assert np.mean(totals) > 1.2 * np.median(totals)  # a long tail: the mean well above the median
    assert peers._rows("sft", 5) == peers._rows("sft", 5)  # seeded
    assert set(peers._rows("sft", 1)[0]) == {"prompt", "completion"}


def test_counts_tell_padding_and_useful_tokens_apart():
    padded = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
              "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
              "labels": torch.tensor([[-100, -100, 7, 8, 9], [-100, 5, 6, -100, -100]])}  # fmt: skip
    assert peers.counts(padded) == (10, 8, 5)
    packed = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "document_ids": torch.tensor([[0, 0, 1, -1]]),
              "labels": torch.tensor([[-100, 3, -100, -100]])}  # fmt: skip
    assert peers.counts(packed) == (4, 3, 1)
    flat = {"input_ids": torch.zeros(1, 6, dtype=torch.long), "completion_mask": torch.tensor([[0, 1, 1, 0, 1, 1]])}
    assert peers.counts(flat) == (6, 6, 4)
    assert peers.attended(padded) == 2 * 5 * 5


@pytest.mark.slow
def test_quick_run_measures_every_variant_and_both_sides_whole_runs(monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.setattr(peers, "QUICK_SHAPE", TINY)
    measured = peers.measure(quick=True)
    timing, runs, tallies = measured["steps"], measured["runs"], measured["tallies"]
    names = {peers.name(side, variant) for side in ("fntrain", "TRL") for variant in peers.VARIANTS}
    assert set(timing.samples) == names
    assert all(len(values) == 1 and values[0] > 0 for values in timing.samples.values())
    for variant in peers.VARIANTS:
        ours, theirs = tallies[variant]["fntrain"], tallies[variant]["TRL"]
        assert sum(ours["useful"]) > 0 and sum(theirs["useful"]) > 0
        if variant[1] == "padded":  # the same work: the same positions, tokens and targets
            assert ours == theirs
    packed = tallies[("sft", "packed")]
    assert peers._share(packed["TRL"]) == 0.0 < peers._share(packed["fntrain"])  # TRL's rows: no padding
    whole = {peers.name(side, variant) for side in ("fntrain", "TRL") for variant in peers.QUICK_WHOLE_RUNS}
    assert set(runs["run"].samples) == whole
    for side in whole:
        assert runs["steps"].samples[side] == [1]
        assert 0 < runs["first_step"].samples[side][0] <= runs["run"].samples[side][0]
        assert 0 < runs["first_step_cpu"].samples[side][0] <= runs["cpu"].samples[side][0]
        assert runs["rss"].samples[side][0] > 100  # MiB: a process that imported torch

    monkeypatch.setattr(peers, "measure", lambda quick: measured)
    table = peers.run(quick=True)
    text = format_table(table)
    assert "SFT padded: command to the first step's end" in text and "DPO padded: padding computed" in text
    assert "SFT, each side's best: useful tokens/s" in text and "SFT, packing against padding: TRL's" in text
    assert all(row.rounds for row in table if row.interval)
