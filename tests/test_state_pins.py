"""Behaviours of the run plan that mutation testing found unpinned (mutation/RESULTS.md): the smallest
legal values are legal (one step, one sample, one-step epochs), counts are ints, drop_last decides the
epoch length, every field of the plan carries its setting, and the error messages name the setting."""

from __future__ import annotations

import pytest

from fntrain.state import RunPlan, TrainState, loader_length, make_run_plan, micro_batches_per_step


def test_smallest_legal_values_are_accepted():
    plan = RunPlan(train_iters=1, steps_per_epoch=1, epochs=1)
    assert (plan.train_iters, plan.steps_per_epoch, plan.lr_schedule_iters) == (1, 1, 1)
    assert RunPlan(train_iters=5, steps_per_epoch=2, epochs=3, lr_schedule_iters=1).lr_schedule_iters == 1
    assert RunPlan(train_iters=5, steps_per_epoch=2, epochs=3).lr_schedule_iters == 5  # 0 means train_iters
    assert make_run_plan(global_batch_size=1, micro_batch_size=1, train_samples=1).train_iters == 1
    assert make_run_plan(global_batch_size=2, micro_batch_size=1, train_iters=1).train_iters == 1
    assert make_run_plan(global_batch_size=1, micro_batch_size=1, train_iters=4, lr_schedule_iters=1).lr_schedule_iters == 1
    one_step_epochs = make_run_plan(global_batch_size=4, micro_batch_size=2, train_iters=3, dataset_len=4)
    assert (one_step_epochs.steps_per_epoch, one_step_epochs.epochs) == (1, 3)


@pytest.mark.parametrize("field", ["train_iters", "steps_per_epoch"])
def test_plan_rejects_zero_lengths(field):
    kwargs = {"train_iters": 3, "steps_per_epoch": 2, "epochs": 2, field: 0}
    with pytest.raises(ValueError, match=f"plan.{field} must be >= 1, got 0"):
        RunPlan(**kwargs)


def test_drop_last_decides_the_epoch_length_and_counts_are_ints():
    # 10 samples over 3 ranks, micro-batches of 2: drop_last keeps 3 per rank (1 micro-batch),
    # padding gives 4 per rank (2 micro-batches).
    assert loader_length(10, 2, 3, True) == 1 and type(loader_length(10, 2, 3, True)) is int
    assert loader_length(10, 2, 3, False) == 2
    assert loader_length(7, 2, 1, True) == 3 and type(loader_length(7, 2, 1, True)) is int
    dropped = make_run_plan(global_batch_size=2, micro_batch_size=1, dp_size=2, train_iters=9, dataset_len=7)
    padded = make_run_plan(global_batch_size=2, micro_batch_size=1, dp_size=2, train_iters=9, dataset_len=7,
                           drop_last=False)
    assert (dropped.steps_per_epoch, dropped.epochs) == (3, 3)  # the default drops the tail
    assert (padded.steps_per_epoch, padded.epochs) == (4, 3)
    uneven = make_run_plan(global_batch_size=6, micro_batch_size=1, dp_size=2, train_iters=2, dataset_len=20)
    assert uneven.steps_per_epoch == 3 and type(uneven.steps_per_epoch) is int  # 10 per rank // 3
    assert type(micro_batches_per_step(8, 2, 2)) is int and micro_batches_per_step(8, 2, 2) == 2


def test_the_plan_carries_every_setting():
    plan = make_run_plan(global_batch_size=12, micro_batch_size=3, dp_size=2, train_iters=5, dataset_len=48)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.dp_size, plan.micro_batches) == (12, 3, 2, 2)
    assert (plan.steps_per_epoch, plan.epochs, plan.sized, plan.lr_schedule_iters) == (4, 2, True, 5)


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"^global_batch_size must be a positive int, got 0$"):
        micro_batches_per_step(0, 1, 1)
    with pytest.raises(ValueError, match=r"^exactly one of train_iters / train_samples must be set, got "):
        make_run_plan(global_batch_size=1, micro_batch_size=1)
    with pytest.raises(ValueError, match=r"must provide one complete optimizer step per epoch"):
        make_run_plan(global_batch_size=1, micro_batch_size=1, train_iters=1, dataset_len=0)


def test_state_as_dict_and_next_epoch():
    state = TrainState(epoch=2, global_step=7, cursor=3)
    assert state.as_dict() == {"epoch": 2, "global_step": 7, "cursor": 3}
    assert state.next_epoch() == TrainState(epoch=3, global_step=7, cursor=0)
