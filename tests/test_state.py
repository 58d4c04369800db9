"""TrainState transitions and RunPlan arithmetic and errors [S5]-[S8] [S12]."""

import ast
from pathlib import Path

import pytest

from fntrain.state import (
    GenerationShape,
    RunPlan,
    TrainState,
    loader_length,
    make_run_plan,
    micro_batches_per_step,
)


def test_train_state_is_frozen_and_transitions_are_pure():
    state = TrainState()
    assert (state.epoch, state.global_step, state.cursor) == (0, 0, 0)
    after = state.after_step()
    assert after == TrainState(0, 1, 1) and state == TrainState()
    assert after.next_epoch() == TrainState(1, 1, 0)
    with pytest.raises(AttributeError):
        state.epoch = 3  # type: ignore[misc]


@pytest.mark.parametrize("field", ["epoch", "global_step", "cursor"])
def test_train_state_rejects_negative_or_non_int(field):
    with pytest.raises(ValueError, match=f"TrainState.{field}"):
        TrainState(**{field: -1})
    with pytest.raises(ValueError, match=f"TrainState.{field}"):
        TrainState(**{field: 1.0})


def test_micro_batches_divides_exactly():
    assert micro_batches_per_step(32, 4, 2) == 4
    with pytest.raises(ValueError) as error:
        micro_batches_per_step(30, 4, 2)
    message = str(error.value)
    assert "30" in message and "4" in message and "2" in message


def test_run_length_exactly_one_of_iters_samples():
    with pytest.raises(ValueError, match="exactly one of train_iters / train_samples"):
        make_run_plan(global_batch_size=8, micro_batch_size=8, train_iters=3, train_samples=80)
    with pytest.raises(ValueError, match="exactly one of train_iters / train_samples"):
        make_run_plan(global_batch_size=8, micro_batch_size=8)


def test_train_samples_gives_iters_and_must_be_at_least_one_step():
    plan = make_run_plan(global_batch_size=8, micro_batch_size=8, train_samples=83, dataset_len=1000)
    assert plan.train_iters == 10
    with pytest.raises(ValueError, match=r"train_samples \(7\) // global_batch_size \(8\)"):
        make_run_plan(global_batch_size=8, micro_batch_size=8, train_samples=7)


def test_steps_per_epoch_counts_optimizer_steps():
    # 100 samples, dp 2 -> 50 per rank, micro-batch 5 -> 10 micro-batches, 2 per step -> 5 steps.
    plan = make_run_plan(global_batch_size=20, micro_batch_size=5, dp_size=2, train_iters=12, dataset_len=100)
    assert (plan.micro_batches, plan.steps_per_epoch, plan.epochs) == (2, 5, 3)
    assert plan.lr_schedule_iters == 12


def test_one_complete_step_per_epoch_required():
    with pytest.raises(ValueError, match="must provide one complete optimizer step per epoch"):
        make_run_plan(global_batch_size=64, micro_batch_size=8, train_iters=1, dataset_len=40)


def test_unsized_dataset_epoch_is_the_whole_run():
    plan = make_run_plan(global_batch_size=4, micro_batch_size=2, train_iters=7, dataset_len=None)
    assert (plan.steps_per_epoch, plan.epochs, plan.sized) == (7, 1, False)


def test_lr_schedule_horizon():
    plan = make_run_plan(global_batch_size=4, micro_batch_size=4, train_iters=5, lr_schedule_iters=50)
    assert plan.lr_schedule_iters == 50
    with pytest.raises(ValueError, match="lr_schedule_iters must be a positive int, got 0"):
        make_run_plan(global_batch_size=4, micro_batch_size=4, train_iters=5, lr_schedule_iters=0)


def test_loader_length_matches_distributed_sampler_semantics():
    assert loader_length(10, 3, 3, drop_last=True) == 1  # 3 per rank -> 1 batch of 3
    assert loader_length(10, 3, 3, drop_last=False) == 2  # 4 per rank (padded) -> 2 batches
    assert loader_length(10, 2, 1, drop_last=False) == 5


def test_steps_in_epoch_is_bounded_by_epoch_and_run():
    plan = RunPlan(train_iters=10, steps_per_epoch=4, epochs=3)
    assert plan.steps_in_epoch(TrainState(0, 0, 0)) == 4
    assert plan.steps_in_epoch(TrainState(1, 5, 1)) == 3
    assert plan.steps_in_epoch(TrainState(2, 8, 0)) == 2
    assert plan.steps_in_epoch(TrainState(1, 8, 4)) == 0


@pytest.mark.parametrize("module", ["fntrain/state.py", "fntrain/loop.py"])
def test_state_and_loop_import_no_torch(module):
    tree = ast.parse((Path(__file__).parents[1] / module).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported and "numpy" not in imported


def test_import_fntrain_is_light():
    import sys

    from tests.helpers.waiting import run_to_end

    code = (
        "import sys, fntrain; "
        "heavy = sorted(m for m in ('torch', 'tyro', 'tqdm', 'matplotlib') if m in sys.modules); print(heavy)"
    )
    done = run_to_end([sys.executable, "-c", code], "the import of fntrain", 120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "[]"


def test_a_generating_objective_plans_whole_generation_batches_each_serving_several_steps():
    """GRPO reads `rows_per_read` prompts per generation batch (every rank the same rows), each batch
    serving `steps_per_read` optimizer steps: an epoch is the dataset's whole batches times that."""
    plan = make_run_plan(global_batch_size=8, micro_batch_size=4, dp_size=2, train_iters=20, dataset_len=10,
                         generation=GenerationShape(prompts=4, steps=3))  # fmt: skip
    assert (plan.steps_per_epoch, plan.epochs, plan.steps_per_read, plan.micro_batches) == (6, 4, 3, 1)
    assert make_run_plan(global_batch_size=8, micro_batch_size=4, train_iters=2, dataset_len=10).steps_per_read == 1
    with pytest.raises(ValueError, match=r"^the dataset \(3 prompts\) must provide one complete generation batch per "
                                         r"epoch \(4 prompts\)$"):  # fmt: skip
        make_run_plan(global_batch_size=8, micro_batch_size=4, train_iters=2, dataset_len=3,
                      generation=GenerationShape(prompts=4, steps=1))
