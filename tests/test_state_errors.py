"""Every run-length error of `fntrain.state` names its setting and value [S5]-[S8]; a missing bundled
corpus names itself."""

from __future__ import annotations

import pytest

from fntrain.data.corpora import corpus_path
from fntrain.state import RunPlan, make_run_plan, micro_batches_per_step


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"train_iters": 0, "steps_per_epoch": 1}, r"plan.train_iters must be >= 1, got 0"),
        ({"train_iters": 3, "steps_per_epoch": 0}, r"plan.steps_per_epoch must be >= 1, got 0"),
    ],
)
def test_a_plan_needs_steps(fields, message):
    with pytest.raises(ValueError, match=message):
        RunPlan(epochs=1, **fields)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train_samples": 0}, r"train_samples must be a positive int, got 0"),
        ({"train_samples": 2.5}, r"train_samples must be a positive int, got 2.5"),
        ({"train_iters": True}, r"train_iters must be a positive int, got True"),
        ({"train_iters": 2, "dataset_len": -1}, r"dataset_len must be a non-negative int, got -1"),
        ({"train_iters": 2, "dataset_len": 8.0}, r"dataset_len must be a non-negative int, got 8.0"),
    ],
)
def test_run_length_errors_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_run_plan(global_batch_size=4, micro_batch_size=2, **kwargs)


def test_batch_sizes_must_be_positive_ints():
    assert micro_batches_per_step(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"dp_size must be a positive int, got 0"):
        micro_batches_per_step(8, 2, 0)
    with pytest.raises(ValueError, match=r"micro_batch_size must be a positive int, got 2.0"):
        micro_batches_per_step(8, 2.0, 1)


def test_a_missing_corpus_is_named():
    assert corpus_path().name == "shakespeare.txt" and corpus_path().is_file()
    with pytest.raises(
        FileNotFoundError, match=r"no bundled corpus named 'klingon' \(.*klingon.txt does not exist\)"
    ):
        corpus_path("klingon")
