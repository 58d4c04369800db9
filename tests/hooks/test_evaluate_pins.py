"""Behaviours of the evaluation hook that mutation testing found unpinned (mutation/RESULTS.md): how a
split is cut into micro-batches (a one-sample split, a rank's single filler sample) and the messages for
a bad size, an empty split or a dataset that is not map-style; an objective's `(loss, metrics)` reported
as `val_<name>` weighted like the loss, fillers excluded; the exact weighted mean in float64 (16M-token
splits, metrics given as float32 tensors), summed over the evaluation group's ranks only; sums made on
the runtime's device whatever torch's default device; the forward under autocast to the dtype asked;
no loss tokens, one token, an overflowing perplexity; weighting by samples and a custom ignore_index;
the hook's reserved-name error, what rank 0 logs, the forced last step, and an old state without a step.
"""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch

from fntrain.hooks import evaluate as hook_module
from fntrain.hooks.evaluate import EvalParts, EvaluateConfig, eval_index_groups, evaluate_hook, make_eval_fn
from fntrain.loop import Event, StepInfo
from fntrain.runtime import collectives
from fntrain.runtime.runtime import Runtime
from fntrain.step import causal_lm_loss
from tests.hooks.drive import state_at
from tests.hooks.test_evaluate import EvalLM, Samples, reference_loss

# ----------------------------------------------------------------------------- fakes


def scored(tokens: int, loss: float, **metrics: float) -> dict[str, torch.Tensor]:
    """One sample whose loss (and metrics) the fake loss reads back, with `tokens` valid loss tokens."""
    sample = {
        "shift_labels": torch.zeros(tokens, dtype=torch.long),
        "loss": torch.tensor(loss, dtype=torch.float64),
    }
    sample.update((name, torch.tensor(value, dtype=torch.float64)) for name, value in metrics.items())
    return sample


def read_back(model, micro_batch):
    """The forward: the micro-batch itself (the fake loss reads the sample's own numbers)."""
    return micro_batch


def plain_loss(output, micro_batch):
    """The mean of the micro-batch's samples' `loss`, as a 0-d float64 tensor."""
    return output["loss"].mean()


def objective_loss(output, micro_batch):
    """An objective's `(loss, metrics)`: every key but the labels and the loss is a metric."""
    metrics = {name: value.mean() for name, value in output.items() if name not in ("shift_labels", "loss")}
    return output["loss"].mean(), metrics


def evaluate(samples, loss_fn=plain_loss, *, micro_batch_size=1, runtime=None, group=None, **parts):
    eval_fn = make_eval_fn(
        torch.nn.Identity(), loss_fn, samples, micro_batch_size=micro_batch_size,
        runtime=runtime or Runtime(), parts=EvalParts(forward=read_back, **parts), group=group,
    )  # fmt: skip
    return eval_fn()


def one_sample_batch(samples):
    """Collate for micro_batch_size 1 without stacking (lets a sample hold a 16M-token expanded tensor)."""
    (sample,) = samples
    return sample


# ----------------------------------------------------------------------------- the split's micro-batches


@pytest.mark.parametrize(
    ("length", "micro_batch_size", "rank", "world", "groups"),
    [
        (1, 1, 0, 1, [([0], True)]),  # a one-sample split is a split
        (1, 4, 0, 1, [([0], True)]),
        (5, 2, 1, 2, [([1, 3], True), ([1], False)]),  # the rank ran out: one sample, uncounted
        (7, 3, 2, 3, [([2, 5], True)]),
    ],
)
def test_index_groups(length, micro_batch_size, rank, world, groups):
    assert eval_index_groups(length, micro_batch_size, rank, world) == groups


@pytest.mark.parametrize(
    ("length", "micro_batch_size", "error", "message"),
    [
        (4, 0, ValueError, r"^evaluate\.micro_batch_size must be >= 1, got 0$"),
        (4, -3, ValueError, r"^evaluate\.micro_batch_size must be >= 1, got -3$"),
        (4, 2.0, TypeError, r"^evaluate\.micro_batch_size must be an int, got 2\.0$"),
        (0, 2, ValueError, r"^the validation split is empty$"),
    ],
)
def test_bad_split_or_micro_batch_size_is_one_message(length, micro_batch_size, error, message):
    with pytest.raises(error, match=message):
        eval_index_groups(length, micro_batch_size, 0, 1)


class OnlyGetItem:
    def __getitem__(self, index):
        return {}


class OnlyLen:
    def __len__(self):
        return 3


@pytest.mark.parametrize("dataset", [OnlyGetItem(), OnlyLen(), iter([1, 2])])
def test_a_dataset_that_is_not_map_style_is_refused_naming_its_type(dataset):
    message = f"the validation dataset must be map-style (__getitem__ and __len__), got {type(dataset)!r}"
    with pytest.raises(TypeError) as raised:
        make_eval_fn(torch.nn.Identity(), plain_loss, dataset, micro_batch_size=1, runtime=Runtime())
    assert str(raised.value) == message


# ----------------------------------------------------------------------------- what an evaluation reports


def test_an_objectives_metrics_are_reported_token_weighted_instead_of_the_perplexity():
    samples = [scored(2, 1.0, acc=0.5, margin=-1.0), scored(3, 2.0, acc=1.0, margin=2.0),
               scored(5, 4.0, acc=0.0, margin=3.0)]  # fmt: skip
    result = evaluate(samples, objective_loss)
    assert result == pytest.approx({"val_loss": 28 / 10, "val_acc": 4 / 10, "val_margin": 19 / 10}, rel=1e-12)


def test_a_filler_micro_batch_adds_nothing_to_the_metrics():
    samples = [scored(2, 1.0, acc=0.25), scored(3, 2.0, acc=0.75), scored(4, 3.0, acc=0.5)]
    # rank 1 of 2 reads sample 1, then repeats it uncounted to match rank 0's two micro-batches
    result = evaluate(samples, objective_loss, runtime=Runtime(rank=1, world_size=2, dp_rank=1, dp_size=2))
    assert result == pytest.approx({"val_loss": 2.0, "val_acc": 0.75}, rel=1e-12)


BIG = 2**24 + 1  # the first count float32 cannot hold


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([scored(3, 1 / 3), scored(1, 0.1)], (1.0 + 0.1) / 4),  # values float32 would round
        ([dict(scored(0, 1.0), shift_labels=torch.zeros((), dtype=torch.long).expand(BIG))], 1.0),
    ],
    ids=["float64-values", "16M-tokens"],
)
def test_val_loss_is_the_exact_weighted_mean_in_float64(samples, expected):
    result = evaluate(samples, collate_fn=one_sample_batch)
    assert result["val_loss"] == pytest.approx(expected, rel=1e-15, abs=0)


def test_a_metric_given_as_a_float32_one_element_tensor_is_weighted_in_float64():
    third = torch.tensor([1 / 3], dtype=torch.float32)
    samples = [scored(3, 1.0), scored(3, 1.0)]

    def loss_fn(output, micro_batch):
        return output["loss"].mean(), {"share": third}

    result = evaluate(samples, loss_fn, collate_fn=one_sample_batch)
    assert result["val_share"] == pytest.approx(float(third), rel=1e-15, abs=0)


def test_the_sums_are_made_on_the_runtimes_device_whatever_torchs_default_device():
    samples = [scored(2, 1.0, acc=0.5), scored(3, 2.0, acc=1.0)]
    expected = evaluate(samples, objective_loss)
    with torch.device("meta"):  # a tensor made without the runtime's device would land here
        assert evaluate(samples, objective_loss) == expected
        assert evaluate(samples)["val_loss"] == expected["val_loss"]


def test_the_forward_runs_under_autocast_to_the_dtype_asked_with_the_model_and_micro_batch():
    model, dataset, seen = EvalLM(), Samples(), []

    def forward(module, micro_batch):
        seen.append((module is model, sorted(micro_batch), torch.is_autocast_enabled("cpu"),
                     torch.get_autocast_dtype("cpu")))  # fmt: skip
        return module(micro_batch["input_ids"])

    eval_fn = make_eval_fn(model, causal_lm_loss, dataset, micro_batch_size=4, runtime=Runtime(),
                           parts=EvalParts(forward=forward, autocast_dtype=torch.float16))  # fmt: skip
    result = eval_fn()
    assert seen == [(True, ["input_ids", "labels"], True, torch.float16)] * 2
    assert result["val_loss"] == pytest.approx(reference_loss(model, dataset), rel=1e-2)


def test_a_split_without_loss_tokens_reports_nan_and_warns(caplog):
    samples = [scored(0, 1.0), scored(0, 2.0)]
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.evaluate"):
        result = evaluate(samples)
    assert set(result) == {"val_loss", "val_ppl"}
    assert math.isnan(result["val_loss"]) and math.isnan(result["val_ppl"])
    assert caplog.messages == ["evaluation: the validation split has no valid loss tokens"]


def test_a_single_loss_token_is_enough(caplog):
    with caplog.at_level(logging.WARNING, logger="fntrain.hooks.evaluate"):
        result = evaluate([scored(0, 5.0), scored(1, 0.5)])
    assert result == pytest.approx({"val_loss": 0.5, "val_ppl": math.exp(0.5)}, rel=1e-12)
    assert caplog.messages == []


def test_a_perplexity_too_large_for_a_float_is_infinite():
    assert evaluate([scored(2, 1000.0)]) == {"val_loss": 1000.0, "val_ppl": math.inf}


def test_mean_weighting_weights_micro_batches_by_their_samples():
    samples = [scored(1, 1.0), scored(1, 1.0), scored(6, 4.0)]  # micro-batches: 2 samples/2 tokens, 1/6
    by_samples = evaluate(samples, micro_batch_size=2, weighting="mean")
    by_tokens = evaluate(samples, micro_batch_size=2)
    assert by_samples["val_loss"] == pytest.approx((2 * 1.0 + 1 * 4.0) / 3, rel=1e-12)
    assert by_tokens["val_loss"] == pytest.approx((2 * 1.0 + 6 * 4.0) / 8, rel=1e-12)


def test_the_ignore_index_asked_decides_the_token_weights():
    samples = [scored(4, 1.0), scored(4, 3.0)]
    samples[0]["shift_labels"][1:] = -1  # one valid target under ignore_index=-1, four under -100
    assert evaluate(samples, ignore_index=-1)["val_loss"] == pytest.approx((1.0 + 12.0) / 5, rel=1e-12)
    assert evaluate(samples)["val_loss"] == pytest.approx((4.0 + 12.0) / 8, rel=1e-12)


# ----------------------------------------------------------------------------- across ranks


class OtherGroupRanks:
    """`torch.distributed` for one rank of four: the evaluation group is this rank and one other (2 ranks);
    the world adds two ranks of another group. all_reduce adds the other members' sums (SUM only)."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, group, partner, strangers):
        self.group, self.partner, self.strangers = group, partner, strangers

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self, group=None):
        return 2 if group is self.group else 4

    def all_reduce(self, tensor, op=None, group=None):
        assert op == self.ReduceOp.SUM
        others = [self.partner] if group is self.group else [self.partner, *self.strangers]
        for other in others:
            tensor += torch.tensor(other, dtype=tensor.dtype)


def test_the_sums_are_reduced_over_the_evaluation_group_in_float64(monkeypatch):
    group = object()
    # [loss x tokens, tokens, acc x tokens] of the partner: 16M tokens at loss 1, acc 0.5
    partner, strangers = [float(BIG), float(BIG), BIG / 2], [[100.0, 1.0, 0.0]] * 2
    monkeypatch.setattr(collectives, "dist", OtherGroupRanks(group, partner, strangers))
    samples = [scored(3, 1 / 3, acc=1.0)]
    result = evaluate(samples, objective_loss, runtime=Runtime(rank=0, world_size=4, dp_size=2), group=group)
    tokens = BIG + 3
    assert result["val_loss"] == pytest.approx((BIG + 1.0) / tokens, rel=1e-15, abs=0)
    assert result["val_acc"] == pytest.approx((BIG / 2 + 3) / tokens, rel=1e-15, abs=0)


# ----------------------------------------------------------------------------- the hook


@pytest.mark.parametrize("name", ["step", "epoch", "attempt"])
def test_a_metric_named_like_the_records_position_is_refused(name):
    hook = evaluate_hook(EvaluateConfig(eval_every=1), lambda: {"val_loss": 1.0, name: 2}, Runtime())
    with pytest.raises(ValueError) as raised:
        hook(Event.STEP_END, state_at(1), StepInfo({}))
    assert str(raised.value) == f"metric name collision: {name!r} is reserved for the record's position"


def test_at_end_without_the_last_step_is_refused_with_its_message():
    with pytest.raises(ValueError) as raised:
        evaluate_hook(EvaluateConfig(at_end=True), lambda: {}, Runtime())
    assert str(raised.value) == "evaluate.at_end needs the run's last step (last_step=plan.train_iters)"


@pytest.mark.parametrize(
    ("rank", "messages"),
    [
        (0, ["evaluation at step 3 took 2.50s", "step=3 epoch=1 val_loss=2 val_ppl=7.389"]),
        (1, []),
    ],
)
def test_without_a_writer_rank_zero_logs_the_time_taken_and_the_record(monkeypatch, caplog, rank, messages):
    now = [100.0]
    monkeypatch.setattr(hook_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def eval_fn():
        now[0] += 2.5
        return {"val_loss": 2.0, "val_ppl": math.exp(2.0)}

    hook = evaluate_hook(EvaluateConfig(eval_every=3), eval_fn, Runtime(rank=rank, world_size=2))
    with caplog.at_level(logging.INFO, logger="fntrain.hooks.evaluate"):
        hook(Event.STEP_END, state_at(3, epoch=1), StepInfo({}))
    assert caplog.messages == messages


@pytest.mark.parametrize(("at_end", "evaluated"), [(True, [3, 5]), (False, [3])])
def test_at_end_adds_the_last_step_to_the_cadence(at_end, evaluated):
    steps = []
    current = [0]
    config = EvaluateConfig(eval_every=3, at_end=at_end)
    hook = evaluate_hook(config, lambda: steps.append(current[0]) or {}, Runtime(), last_step=5)
    for step in range(1, 6):
        current[0] = step
        hook(Event.STEP_END, state_at(step), StepInfo({}))
    assert steps == evaluated


def test_a_saved_state_without_a_step_is_a_fresh_hooks():
    evaluated = []
    hook = evaluate_hook(EvaluateConfig(eval_every=1), lambda: evaluated.append(1) or {}, Runtime())
    fresh = hook.state_dict()
    hook.load_state_dict({})
    assert hook.state_dict() == fresh == {"last_step": -1}
    hook(Event.STEP_END, state_at(1), StepInfo({}))
    assert evaluated == [1]
