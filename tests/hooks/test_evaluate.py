"""Evaluation [S32]: cadence, at most once per step, no grad, train mode restored, token-weighted sharding."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fntrain.hooks.evaluate import EvaluateConfig, eval_index_groups, evaluate_hook, make_eval_fn
from fntrain.hooks.metrics import MetricsConfig
from fntrain.hooks.metrics_log import metrics_log
from fntrain.loop import Event, StepInfo
from fntrain.runtime.runtime import Runtime
from fntrain.state import TrainState
from fntrain.step import causal_lm_loss
from tests.helpers.waiting import spawn_to_end
from tests.hooks.drive import state_at


class EvalLM(torch.nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(width, vocab)
        self.grad_enabled: list[bool] = []
        self.modes: list[bool] = []

    def forward(self, input_ids, **_):
        self.grad_enabled.append(torch.is_grad_enabled())
        self.modes.append(self.training)
        return self.head(self.drop(self.embed(input_ids)))


class Samples(torch.utils.data.Dataset):
    """Sequences of varying valid-label counts (ignored labels), so token weighting matters."""

    def __init__(self, count: int = 7, length: int = 6):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 11, (count, length), generator=generator)
        self.labels = self.ids.clone()
        for index in range(count):
            self.labels[index, length - index % 4 :] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def reference_loss(model: EvalLM, dataset: Samples) -> float:
    """Token-weighted mean next-token loss over the whole dataset, computed in one go."""
    model.eval()
    with torch.no_grad():
        logits = model(dataset.ids)[:, :-1]
        targets = dataset.labels[:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).double(), targets.reshape(-1), ignore_index=-100
        ).item()


def test_index_groups_cover_each_sample_once_with_equal_counts_per_rank():
    length, world, mbs = 11, 3, 2
    per_rank = [eval_index_groups(length, mbs, rank, world) for rank in range(world)]
    assert {len(groups) for groups in per_rank} == {2}  # ceil(ceil(11 / 3) / 2)
    counted = sorted(i for groups in per_rank for indices, real in groups if real for i in indices)
    assert counted == list(range(length))
    assert eval_index_groups(2, 1, 2, 3) == [([0], False)]  # a rank with no sample runs one uncounted forward
    assert eval_index_groups(100, 4, 0, 1, max_batches=3) == [
        ([0, 1, 2, 3], True),
        ([4, 5, 6, 7], True),
        ([8, 9, 10, 11], True),
    ]
    with pytest.raises(ValueError, match="empty"):
        eval_index_groups(0, 2, 0, 1)


def test_eval_fn_is_the_exact_token_weighted_loss_and_ppl():
    model, dataset = EvalLM(), Samples()
    eval_fn = make_eval_fn(model, causal_lm_loss, dataset, micro_batch_size=3, runtime=Runtime())
    result = eval_fn()
    expected = reference_loss(model, dataset)
    assert set(result) == {"val_loss", "val_ppl"}
    assert result["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert result["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-6)


def test_eval_runs_without_grad_in_eval_mode_and_restores_the_mode():
    model, dataset = EvalLM(), Samples()
    eval_fn = make_eval_fn(model, causal_lm_loss, dataset, micro_batch_size=4, runtime=Runtime())
    model.train()
    first, second = eval_fn(), eval_fn()
    assert first == second  # dropout off: deterministic
    assert model.training is True
    assert model.grad_enabled == [False] * 4 and model.modes == [False] * 4
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    eval_fn()
    assert model.training is False  # the caller's mode, whatever it was


def test_train_mode_restored_when_the_eval_fails():
    model = EvalLM()

    def broken_loss(output, batch):
        raise RuntimeError("bad batch")

    eval_fn = make_eval_fn(model, broken_loss, Samples(), micro_batch_size=4, runtime=Runtime())
    model.train()
    with pytest.raises(RuntimeError, match="bad batch"):
        eval_fn()
    assert model.training is True


def test_max_batches_limits_the_work():
    model = EvalLM()
    eval_fn = make_eval_fn(
        model, causal_lm_loss, Samples(), micro_batch_size=2, runtime=Runtime(), max_batches=1
    )
    eval_fn()
    assert len(model.grad_enabled) == 1


def test_cadence_by_steps_epochs_and_end_at_most_once_per_step():
    calls = []

    def eval_fn():
        calls.append(current[0])
        return {"val_loss": 1.0}

    current = [0]
    hook = evaluate_hook(
        EvaluateConfig(eval_every=2, eval_epochs=1, at_end=True), eval_fn, Runtime(), last_step=5
    )
    hook(Event.TRAIN_BEGIN, TrainState(), None)
    for step in range(1, 6):
        current[0] = step
        hook(Event.STEP_END, state_at(step), StepInfo({}))
        if step == 4:  # epoch 0 ends on step 4, already evaluated at its STEP_END
            hook(Event.EPOCH_END, state_at(step), None)
    current[0] = 5
    hook(Event.EPOCH_END, state_at(5, epoch=1), None)
    hook(Event.TRAIN_END, state_at(5, epoch=2), None)
    assert calls == [2, 4, 5]


def test_eval_epochs_counts_finished_epochs():
    calls = []
    hook = evaluate_hook(EvaluateConfig(eval_epochs=2), lambda: calls.append(1) or {}, Runtime())
    for epoch in range(4):
        hook(Event.EPOCH_END, TrainState(epoch=epoch, global_step=epoch + 1), None)
    assert len(calls) == 2  # after epochs 2 and 4 (0-based 1 and 3)


def test_evaluated_step_survives_a_resume():
    calls = []
    config = EvaluateConfig(eval_epochs=1)
    first = evaluate_hook(config, lambda: calls.append(1) or {}, Runtime())
    first(Event.EPOCH_END, state_at(10), None)
    resumed = evaluate_hook(config, lambda: calls.append(2) or {}, Runtime())
    resumed.load_state_dict(first.state_dict())
    # a checkpoint taken on the epoch's last step resumes by firing that EPOCH_END again [S12]
    resumed(Event.EPOCH_END, state_at(10), None)
    assert calls == [1] and resumed.name == "evaluate"


def test_result_is_written_as_its_own_record_on_rank_zero(tmp_path):
    for rank, run_dir in ((0, tmp_path / "r0"), (1, tmp_path / "r1")):
        runtime = Runtime(rank=rank, world_size=2)
        writer = metrics_log(MetricsConfig(), runtime, run_dir)
        hook = evaluate_hook(
            EvaluateConfig(eval_every=3),
            lambda: {"val_loss": 2.0, "val_ppl": math.exp(2.0)},
            runtime,
            writer=writer,
        )
        hook(Event.STEP_END, state_at(3, epoch=1), StepInfo({}))
        writer.stop()
    record = json.loads((tmp_path / "r0" / "metrics.jsonl").read_text())
    assert record == {"step": 3, "epoch": 1, "attempt": 0, "val_loss": 2.0, "val_ppl": math.exp(2.0)}
    assert not (tmp_path / "r1").exists()


def test_abort_before_train_begin_is_a_no_op_and_config_is_validated():
    evaluated = []
    hook = evaluate_hook(EvaluateConfig(eval_every=1), lambda: evaluated.append(1) or {}, Runtime())
    hook(Event.ABORT, TrainState(), RuntimeError("boom"))
    assert evaluated == [] and hook.state_dict() == {"last_step": -1}  # no evaluation on an abort
    with pytest.raises(ValueError, match="evaluate.eval_every"):
        EvaluateConfig(eval_every=-1).validate()
    with pytest.raises(TypeError, match="evaluate.at_end"):
        EvaluateConfig(at_end=1).validate()
    with pytest.raises(ValueError, match="last_step"):
        evaluate_hook(EvaluateConfig(at_end=True), lambda: {}, Runtime())
    assert not EvaluateConfig().enabled and EvaluateConfig(eval_epochs=1).enabled


# ----------------------------------------------------------------------------- two ranks (gloo)


def _two_rank_eval(rank: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        runtime = Runtime(rank=rank, world_size=2, dp_size=2, dp_rank=rank, backend="gloo")
        eval_fn = make_eval_fn(EvalLM(), causal_lm_loss, Samples(), micro_batch_size=2, runtime=runtime)
        result = eval_fn()
        if rank == 0:
            with open(out_file, "w") as file:
                json.dump(result, file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_give_the_single_rank_result(tmp_path):
    out = tmp_path / "result.json"
    spawn_to_end(_two_rank_eval, (str(tmp_path / "init"), str(out)), 2, "the two evaluating ranks", 120)
    two_ranks = json.loads(out.read_text())
    one_rank = make_eval_fn(EvalLM(), causal_lm_loss, Samples(), micro_batch_size=2, runtime=Runtime())()
    assert two_ranks["val_loss"] == pytest.approx(one_rank["val_loss"], rel=1e-6)  # float32 forwards


def test_with_validation_resolves_to_a_cadence_only_when_none_is_set():
    """[issue 27] the cadence a validation split implies, and the user's own winning over it."""
    auto = EvaluateConfig(with_validation=True)
    assert not auto.enabled  # a recipe may default to it without needing a validation split
    assert auto.resolved(True, 100) == EvaluateConfig(with_validation=True, eval_every=10, at_end=True)
    assert auto.resolved(True, 5).eval_every == 1
    assert auto.resolved(False, 100) == auto
    own = EvaluateConfig(with_validation=True, eval_every=7)
    assert own.resolved(True, 100) == own
    assert EvaluateConfig().resolved(True, 100) == EvaluateConfig()
    assert auto.resolved(True, 100).describe() == "every 10 steps and at the end"
    assert EvaluateConfig(eval_epochs=2).describe() == "every 2 epochs" and EvaluateConfig().describe() == "never"
