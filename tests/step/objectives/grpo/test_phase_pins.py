"""Pins for fntrain/step/objectives/grpo/phase.py (mutation testing, issue 49 item 4): what a GRPO run logs
and counts across generation batches and resumes (num_tokens, the regeneration warnings, a saved batch
refused for another shape or a missing reference), where the module's tests left it open."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from fntrain.state import TrainState
from fntrain.step.objectives.grpo.phase import rollout_phase
from fntrain.step.objectives.grpo.rollout import rollout
from tests.step.objectives.grpo.test_rollout import (
    _logps,
    _policy,
    _prompts,
    _settings,
    _Train,
    rollout_parts,
)


def _phase(settings, made=None, reference=None):
    parts = rollout_parts(_policy(), reference=reference)

    def generate(state, prompts, index):
        if made is not None:
            made.append((state, index))
        return rollout(prompts, index, parts, settings, state)

    return rollout_phase(generate, settings)


def test_num_tokens_adds_every_generation_batch_and_a_resume_continues_the_count():
    """TRL's num_tokens is the running total of every generation batch's tokens, kept by a checkpoint."""
    settings = _settings(num_iterations=2)  # R = 2 steps a generation batch
    phase, train = _phase(settings), _Train()
    first = phase.step(TrainState(0, 0, 0), [_prompts(1)], train)["num_tokens"]
    phase.step(TrainState(0, 1, 1), [_prompts(1)], train)
    saved = json.loads(json.dumps(phase.state_hook.state_dict()))
    both = phase.step(TrainState(0, 2, 2), [_prompts(1, start=1)], train)["num_tokens"]
    assert 0 < first < both
    resumed = _phase(settings)
    resumed.state_hook.load_state_dict(saved)
    assert resumed.step(TrainState(0, 2, 2), [_prompts(1, start=1)], _Train())["num_tokens"] == both


def test_generate_gets_the_loops_state(caplog):
    settings = _settings()
    made = []
    state = TrainState(0, 0, 0)
    _phase(settings, made).step(state, [_prompts(1)], _Train())
    assert made[0][0] is state and made[0][1] == 0


def test_a_step_inside_a_batch_the_checkpoint_did_not_keep_warns_naming_the_steps(caplog):
    settings = _settings(num_iterations=2)
    made = []
    with caplog.at_level(logging.WARNING, logger="fntrain.step.objectives.grpo"):
        _phase(settings, made).step(TrainState(0, 3, 3), [_prompts(1)], _Train())
    assert made[0][1] == 1
    assert caplog.messages == [
        "step 4 is step 2 of generation batch 1, which the checkpoint did not keep: it is generated again "
        "with the current weights"
    ]


def _saved_mid_batch(settings, reference=None):
    phase = _phase(settings, reference=reference)
    phase.step(TrainState(0, 0, 0), [_prompts(1)], _Train())
    return json.loads(json.dumps(phase.state_hook.state_dict()))


def test_a_saved_batch_of_another_shape_is_generated_again_with_a_warning_naming_it(caplog):
    saved = _saved_mid_batch(_settings(num_iterations=2))
    saved["generation"]["micro_batch_size"] = 1
    made = []
    resumed = _phase(_settings(num_iterations=2), made)
    with caplog.at_level(logging.WARNING, logger="fntrain.step.objectives.grpo"):
        resumed.state_hook.load_state_dict(saved)
    assert caplog.messages[0].startswith(
        "the checkpoint's generation batch 0 has another shape than this run's ("
    )
    assert caplog.messages[0].endswith("): it is generated again")
    resumed.step(TrainState(0, 1, 1), [_prompts(1)], _Train())
    assert [index for _, index in made] == [0]


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_a_saved_batch_without_reference_log_probs_is_regenerated_only_when_beta_is_now_positive(
    beta, caplog
):
    saved = _saved_mid_batch(_settings(num_iterations=2))  # made with beta 0: no ref_logps
    made = []
    resumed = _phase(_settings(num_iterations=2, beta=beta), made, reference=_logps)
    with caplog.at_level(logging.WARNING, logger="fntrain.step.objectives.grpo"):
        resumed.state_hook.load_state_dict(saved)
        resumed.step(TrainState(0, 1, 1), [_prompts(1)], _Train())
    if beta:
        assert "holds no reference log-probs (made with grpo.beta 0, this run has 0.1)" in caplog.messages[0]
        assert len(made) == 1
    else:
        assert caplog.messages == [] and made == []


def test_rollout_metrics_colliding_with_the_steps_are_refused_naming_them():
    class Clash(_Train):
        def __call__(self, state, micro_batches):
            return {"loss": torch.tensor(0.0), "reward": torch.tensor(1.0)}

    with pytest.raises(ValueError, match=r"^the rollout's metrics \['reward'\] collide with the step's own$"):
        _phase(_settings()).step(TrainState(0, 0, 0), [_prompts(1)], Clash())


def test_a_checkpoint_right_after_a_resume_keeps_the_same_batch():
    """Resumed inside a generation batch, the next checkpoint writes the batch it restored, unchanged."""
    settings = _settings(num_iterations=3)  # R = 3
    saved = _saved_mid_batch(settings)
    resumed = _phase(settings)
    resumed.state_hook.load_state_dict(saved)
    resumed.step(TrainState(0, 1, 1), [_prompts(1)], _Train())
    assert json.loads(json.dumps(resumed.state_hook.state_dict())) == saved


def test_the_generating_step_alone_logs_its_train_time_and_counts_its_tokens():
    """time/train_s is the seconds of the generating step's optimizer step (logged with the rollout's
    metrics, not at a restored step); count_batch gives the step's trained tokens and rows."""
    settings = _settings(num_iterations=2)
    phase, train = _phase(settings), _Train()
    first = phase.step(TrainState(0, 0, 0), [_prompts(1)], train)
    assert 0 <= first["time/train_s"] < 60
    micro_batches = train.calls[0][1]
    tokens, rows = phase.count_batch(None)
    assert int(tokens) == sum(int(b["attention_mask"].sum()) for b in micro_batches)
    assert rows == sum(b["input_ids"].shape[0] for b in micro_batches)
    resumed = _phase(settings)
    resumed.state_hook.load_state_dict(json.loads(json.dumps(phase.state_hook.state_dict())))
    assert "time/train_s" not in resumed.step(TrainState(0, 1, 1), [_prompts(1)], _Train())


def test_the_checkpointed_state_is_named_grpo():
    assert _phase(_settings()).state_hook.name == "grpo"


def test_a_batch_saved_on_other_ranks_is_refused_saying_how_to_resume():
    settings = _settings(num_iterations=2)
    saved = _saved_mid_batch(settings)
    saved["generation"]["dp_size"] = 2
    with pytest.raises(ValueError) as refused:
        _phase(settings).state_hook.load_state_dict(saved)
    assert str(refused.value) == (
        "the checkpoint was saved inside generation batch 0 on 2 data-parallel ranks, whose rows are split by "
        "rank: resume it on 2 ranks, or from a checkpoint at a generation batch's edge"
    )
