"""Behaviours of `make_train_step` that mutation testing found unpinned (mutation/RESULTS.md): an
objective's own metrics are combined like its loss and merged into the step's; the settings each change
what they claim (autocast dtype, loss context, ignore_index, device, data-parallel group); one valid
token, one trainable parameter, two micro-batches are legal edges; step_end runs after the schedulers;
a non-finite loss or clipped norm is caught in every mode, on every number of ranks, on and off the CPU
(the accelerator's checks run here on CPU tensors, where `torch._assert_async` raises at once, or on the
meta device); and the device checks fall back step by step on a backend without `_assert_async`."""

from __future__ import annotations

import logging

import pytest
import torch

from fntrain.data.tokens import count_loss_tokens
from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step import train_step as step_module
from tests.step.test_train_step import EXACT, FakeDDP, FakeDist, FakeFSDP, make_model, make_samples, split


def _step(model, loss_fn, micro_batches, lr=0.0, **settings):
    step_fn = make_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=lr),
                              settings=StepSettings(**settings))  # fmt: skip
    return step_fn(TrainState(), micro_batches)


# ----------------------------------------------------------------------------- an objective's metrics


def _loss_with_metrics(output, micro_batch):
    """The causal LM loss, reporting itself and a per-micro-batch constant as the objective's metrics."""
    loss = causal_lm_loss(output, micro_batch)
    return loss, {"echo": loss.detach(), "rows": torch.tensor(float(len(micro_batch["input_ids"])))}


@pytest.mark.parametrize("loss_weighting", ["token", "mean"])
@pytest.mark.parametrize("sizes", [[4], [1, 3], [2, 1, 1]])
def test_an_objectives_metrics_are_combined_with_the_losss_weights(loss_weighting, sizes):
    batch = make_samples(4, keep=[0.2, 1.0, 0.5, 0.9])
    parts = split(batch, sizes)
    metrics = _step(make_model(), _loss_with_metrics, parts, loss_weighting=loss_weighting)
    assert set(metrics) >= {"loss", "grad_norm", "lr", "echo", "rows"}
    # A metric that is the micro-batch's loss combines to the step's loss, for any split and mode.
    torch.testing.assert_close(metrics["echo"], metrics["loss"], **EXACT)
    rows = torch.tensor([float(s) for s in sizes])
    if loss_weighting == "mean":
        expected = rows.mean()
    else:
        tokens = torch.stack([count_loss_tokens(p) for p in parts]).float()
        expected = (rows * tokens / tokens.sum()).sum()
    torch.testing.assert_close(metrics["rows"], expected, **EXACT)


def test_an_objective_reporting_metrics_for_some_micro_batches_only_is_a_value_error():
    calls = []

    def sometimes(output, micro_batch):
        calls.append(1)
        loss = causal_lm_loss(output, micro_batch)
        return (loss, {"echo": loss.detach()}) if len(calls) == 1 else loss

    with pytest.raises(
        ValueError, match="^the loss returned metrics for some micro-batches and not for others$"
    ):
        _step(make_model(), sometimes, split(make_samples(4), [2, 2]))


def test_an_objective_metric_named_like_a_step_metric_is_a_value_error():
    def clashing(output, micro_batch):
        loss = causal_lm_loss(output, micro_batch)
        return loss, {"lr": loss.detach(), "grad_norm": loss.detach(), "mine": loss.detach()}

    with pytest.raises(
        ValueError, match=r"^the loss's metrics \['grad_norm', 'lr'\] collide with the step's own$"
    ):
        _step(make_model(), clashing, make_samples(2))


# ----------------------------------------------------------------------------- device checks without the op


def test_a_backend_without_the_message_overload_uses_the_plain_assert(monkeypatch):
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {})
    original, tried = torch._assert_async, []

    def no_message(condition, *message):
        tried.append(len(message))
        if message:
            raise NotImplementedError("Could not run 'aten::_assert_async.msg'")
        return original(condition)

    monkeypatch.setattr(torch, "_assert_async", no_message)
    step_module._device_assert(torch.tensor(True), "fine", FloatingPointError)
    assert step_module._ASSERT_MODES == {"cpu": "plain"}
    with pytest.raises(RuntimeError):  # the plain op itself (immediate on CPU)
        step_module._device_assert(torch.tensor(False), "bad", FloatingPointError)
    assert tried == [1, 0, 0]  # the missing overload is asked for once


def test_host_fallback_checks_the_condition_and_warns_once_naming_the_device(monkeypatch, caplog):
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {})
    tried = []

    def missing(*args):
        tried.append(args)
        raise NotImplementedError("Could not run 'aten::_assert_async'")

    monkeypatch.setattr(torch, "_assert_async", missing)
    with caplog.at_level(logging.WARNING, logger=step_module.__name__):
        for _ in range(3):
            step_module._device_assert(torch.tensor(True), "fine", FloatingPointError)
        with pytest.raises(FloatingPointError, match="^bad step 5$"):
            step_module._device_assert(torch.tensor(False), "bad step 5", FloatingPointError)
    assert len(tried) == 2  # both overloads asked once, then the host check alone
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["torch._assert_async is not available on cpu: step checks now cost a host sync"]


# ----------------------------------------------------------------------------- checks on an accelerator
# Off the CPU the step checks without a host read (`torch._assert_async`); on CPU tensors that op raises
# at once, so the accelerator's rules can be run here.


@pytest.mark.parametrize(
    ("total", "losses", "refused"),
    [
        (0, [0.0, 0.0], False),
        (0, [0.0, 0.5], True),
        (0, [1.0], True),
        (0, [0.25, -0.25], True),  # losses that cancel are still not zero
        (1, [1.0], False),
        (5, [0.5, 2.0], False),
    ],
)
def test_on_an_accelerator_only_a_zero_token_step_with_a_non_zero_loss_is_refused(monkeypatch, total, losses,
                                                                                    refused):  # fmt: skip
    def check():
        step_module._check_zero_tokens(TrainState(global_step=6, cursor=6), torch.tensor(total),
                                       [torch.tensor(x) for x in losses], on_cpu=False)  # fmt: skip

    message = "^step 7 has zero loss tokens but a non-zero loss$"
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {})
    if not refused:
        check()
        return
    with pytest.raises(RuntimeError, match=message):  # the device assert
        check()
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {"cpu": "host"})  # a backend without the op
    with pytest.raises(ValueError, match=message):
        check()


# ----------------------------------------------------------------------------- what the step is built from


def test_a_step_without_an_optimizer_or_trainable_parameters_is_refused():
    model = make_model()
    with pytest.raises(ValueError, match="^make_train_step needs at least one optimizer$"):
        make_train_step(model, causal_lm_loss, [])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="^make_train_step: the model has no trainable parameters$"):
        make_train_step(model, causal_lm_loss, optimizer)


def test_the_clipped_norm_covers_the_trainable_parameters_only():
    model = make_model()
    model.embed.requires_grad_(False)
    metrics = _step(model, causal_lm_loss, make_samples(4), max_grad_norm=1e9)
    grads = [p.grad for p in (model.mix.weight, model.mix.bias, model.head.weight, model.head.bias)]
    assert all(g is None for g in grads)  # zeroed after the step: recompute them
    frozen = make_model()
    frozen.embed.requires_grad_(False)
    batch = make_samples(4)
    causal_lm_loss(frozen(batch["input_ids"]), batch).backward()
    expected = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in frozen.parameters() if p.requires_grad])
    )
    assert expected > 0
    torch.testing.assert_close(metrics["grad_norm"], expected, **EXACT)


def test_a_single_step_token_is_weighted_by_one():
    """One valid token in the whole step: the reported loss is that token's loss, whatever the split."""
    batch = make_samples(3, keep=0.0)
    batch["labels"][1, 3] = batch["input_ids"][1, 3]
    expected = causal_lm_loss(make_model()(batch["input_ids"]), batch).detach()
    metrics = _step(make_model(), causal_lm_loss, split(batch, [1, 1, 1]))
    assert int(metrics["loss_tokens"]) == 1
    torch.testing.assert_close(metrics["loss"], expected, **EXACT)


def test_loss_tokens_are_counted_with_the_ignore_index_the_settings_name():
    batch = make_samples(4, keep=[0.5, 1.0, 0.3, 0.8])
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == -100, -7)
    expected = int((batch["labels"][:, 1:] != -7).sum())
    assert 0 < expected < batch["labels"][:, 1:].numel()

    def loss_fn(output, micro_batch):
        return causal_lm_loss(output, micro_batch, ignore_index=-7)

    metrics = _step(make_model(), loss_fn, split(batch, [1, 3]), ignore_index=-7)
    assert int(metrics["loss_tokens"]) == expected
    whole = _step(make_model(), loss_fn, [batch], ignore_index=-7)
    torch.testing.assert_close(metrics["loss"], whole["loss"], **EXACT)


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16])
def test_the_forward_runs_under_the_autocast_dtype_asked_for(dtype):
    seen = []

    def forward(model, micro_batch):
        logits = model(micro_batch["input_ids"])
        seen.append(logits.dtype)
        return logits

    model = make_model()
    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.0),
                              settings=StepSettings(autocast_dtype=dtype), forward=forward)  # fmt: skip
    step_fn(TrainState(), split(make_samples(4), [2, 2]))
    assert seen == [dtype or torch.float32] * 2


def test_the_loss_context_wraps_every_forward_loss_and_backward():
    events = []

    class Context:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")
            return False

    def forward(model, micro_batch):
        events.append("forward")
        out = model(micro_batch["input_ids"])
        out.register_hook(lambda grad: events.append("backward"))
        return out

    def loss_fn(output, micro_batch):
        events.append("loss")
        return causal_lm_loss(output, micro_batch)

    model = make_model()
    step_fn = make_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0),
                              settings=StepSettings(loss_context=Context), forward=forward)  # fmt: skip
    step_fn(TrainState(), split(make_samples(4), [2, 2]))
    assert events == ["enter", *["forward", "loss", "backward"] * 2, "exit"]


# ----------------------------------------------------------------------------- data parallelism


class GroupDist(FakeDist):
    """FakeDist whose data-parallel group is a named object: only that group has `size` ranks."""

    def __init__(self, other_tokens: int, group: object, size: int = 2, initialized: bool = True):
        super().__init__(other_tokens)
        self.group, self.size, self.initialized, self.groups_used = group, size, initialized, []

    def is_initialized(self) -> bool:
        return self.initialized

    def get_world_size(self, group=None) -> int:
        self.groups_used.append(group)
        return self.size if group is self.group else 99

    def all_reduce(self, tensor, group=None):
        self.groups_used.append(group)
        super().all_reduce(tensor, group)


def test_the_data_parallel_group_is_the_one_checked_and_reduced_over(monkeypatch):
    group = object()
    fake = GroupDist(other_tokens=5, group=group)
    monkeypatch.setattr(step_module, "dist", fake)
    metrics = _step(make_model(), causal_lm_loss, make_samples(2), dp_size=2, dp_group=group)
    assert fake.groups_used == [group, group] and fake.reduced == 1
    assert int(metrics["loss_tokens"]) == int(count_loss_tokens(make_samples(2))) + 5


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        (
            GroupDist(0, None, initialized=False),
            r"^dp_size=2 needs an initialized process group \(see setup_runtime\)$",
        ),
        (GroupDist(0, None, size=3), "^dp_size=2 but the data-parallel group has 3 ranks$"),
    ],
)
def test_a_data_parallel_size_the_process_group_does_not_have_is_refused(monkeypatch, fake, message):
    monkeypatch.setattr(step_module, "dist", fake)
    model = make_model()
    with pytest.raises(ValueError, match=message):
        make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                        settings=StepSettings(dp_size=2))  # fmt: skip


# ----------------------------------------------------------------------------- non-finite steps


def _steep(scale: float):
    """A loss whose value stays finite while its gradients' norm overflows (scale ~1e30)."""

    def loss_fn(output, micro_batch):
        return causal_lm_loss(output, micro_batch) * scale

    return loss_fn


def _inf_loss_finite_grads(output, micro_batch):
    """An infinite loss whose gradients are finite (the infinity is a constant)."""
    return causal_lm_loss(output, micro_batch) + torch.tensor(float("inf"))


def test_a_non_finite_clipped_norm_stops_the_step_naming_it_and_both_numbers():
    model = make_model()
    step_fn = make_train_step(model, _steep(1e30), torch.optim.SGD(model.parameters(), lr=0.0),
                              settings=StepSettings(max_grad_norm=1.0))  # fmt: skip
    with pytest.raises(
        FloatingPointError, match=r"^non-finite loss at step 3: loss \d.*e\+30, grad_norm inf$"
    ):
        step_fn(TrainState(global_step=2, cursor=2), make_samples(2))
    # Without clipping the norm is neither computed nor checked: the finite loss passes.
    metrics = _step(make_model(), _steep(1e30), make_samples(2))
    assert metrics["grad_norm"] == 0.0 and torch.isfinite(metrics["loss"])


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_with_several_ranks_skip_mode_follows_the_synced_gradients_not_the_ranks_loss(
    monkeypatch, max_grad_norm
):
    settings = {"nonfinite": "skip", "max_grad_norm": max_grad_norm}
    # One rank alone: its loss decides.
    assert _step(make_model(), _inf_loss_finite_grads, make_samples(2), **settings)["skipped"] == 1.0
    assert _step(make_model(), _steep(1e30), make_samples(2), **settings)["skipped"] == float(
        max_grad_norm > 0
    )
    monkeypatch.setattr(step_module, "dist", FakeDist(other_tokens=3))
    settings["dp_size"] = 2
    # Two ranks: the gradients' norm, the same on every rank, decides.
    assert _step(make_model(), _inf_loss_finite_grads, make_samples(2), **settings)["skipped"] == 0.0
    assert _step(make_model(), _steep(1e30), make_samples(2), **settings)["skipped"] == 1.0
    assert _step(make_model(), causal_lm_loss, make_samples(2), **settings)["skipped"] == 0.0


def test_with_a_grad_scaler_and_several_ranks_the_scaler_alone_skips(monkeypatch):
    monkeypatch.setattr(step_module, "dist", FakeDist(other_tokens=3))
    model = make_model()
    before = model.head.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**64)
    step_fn = make_train_step(model, _steep(1e20), torch.optim.SGD(model.parameters(), lr=0.1), grad_scaler=scaler,
                              settings=StepSettings(nonfinite="skip", dp_size=2))  # fmt: skip
    metrics = step_fn(TrainState(), make_samples(2))
    assert metrics["skipped"] == 0.0  # the step did not skip: the scaler did, by itself
    assert torch.equal(model.head.weight, before) and scaler.get_scale() < 2.0**64


def test_off_the_cpu_the_step_moves_the_micro_batches_and_counts_on_the_device():
    """On another device (here "meta": shapes without numbers) the forward sees each micro-batch on the
    step's device, a padding micro-batch counts zero tokens there too, and the metrics stay on it."""
    with torch.device("meta"):
        model = make_model()
    seen = []

    def forward(model, micro_batch):
        seen.append(micro_batch["input_ids"].device.type)
        return model(micro_batch["input_ids"])

    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                              settings=StepSettings(max_grad_norm=1.0), forward=forward)  # fmt: skip
    padding = dict(make_samples(2, seed=9), is_padding=True)
    metrics = step_fn(TrainState(), [*split(make_samples(4), [2, 2]), padding])
    assert seen == ["meta"] * 3
    assert {
        name: metrics[name].device.type for name in ("loss", "grad_norm", "loss_tokens")
    } == dict.fromkeys(("loss", "grad_norm", "loss_tokens"), "meta")


def test_mean_mode_reports_no_loss_token_count():
    metrics = _step(make_model(), causal_lm_loss, split(make_samples(4), [2, 2]), loss_weighting="mean")
    assert set(metrics) == {"loss", "grad_norm", "lr"}


@pytest.mark.parametrize("model_cls", [FakeFSDP, FakeDDP])
@pytest.mark.parametrize("count", [2, 4])
def test_gradients_sync_on_the_last_of_any_number_of_micro_batches(model_cls, count):
    torch.manual_seed(0)
    model = model_cls()
    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    step_fn(TrainState(), split(make_samples(count), [1] * count))
    syncing = [False] * (count - 1) + [True]
    assert model.seen == [(kind, sync) for sync in syncing for kind in ("forward", "backward")]


@pytest.mark.parametrize(
    ("clip", "scaler", "loss", "norm", "refused"),
    [
        (True, None, float("inf"), 1.0, True),
        (True, None, 1.0, float("nan"), True),
        (True, None, 1.0, 1.0, False),
        (True, "scaler", 1.0, float("inf"), False),  # a scaler skips inf gradients itself
        (True, "scaler", float("nan"), 1.0, True),
        (False, None, float("nan"), 0.0, True),
        (False, None, 2.0, 0.0, False),
    ],
)
def test_on_an_accelerator_a_non_finite_loss_or_clipped_norm_is_refused_naming_the_step(
    monkeypatch, clip, scaler, loss, norm, refused
):
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {})
    should_skip = step_module._make_nonfinite_check([], on_cpu=False, skip_mode=False, clip=clip, grad_scaler=scaler,
                                                    dp_size=1)  # fmt: skip
    grad_norm = torch.tensor(norm) if clip else norm
    if not refused:
        assert should_skip(4, torch.tensor(loss), grad_norm) is False
        return
    with pytest.raises(RuntimeError, match="^non-finite loss or gradient norm at step 4$"):
        should_skip(4, torch.tensor(loss), grad_norm)
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {"cpu": "host"})  # a backend without the op
    with pytest.raises(FloatingPointError, match="^non-finite loss or gradient norm at step 4$"):
        should_skip(4, torch.tensor(loss), grad_norm)


class _Seen(Exception):
    pass


def test_the_micro_batches_go_to_the_device_the_settings_name():
    seen = []

    def forward(model, micro_batch):
        seen.append(micro_batch["input_ids"].device.type)
        raise _Seen  # the device is all this test needs

    model = make_model()  # on the CPU; the settings name another device
    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                              settings=StepSettings(device=torch.device("meta")), forward=forward)  # fmt: skip
    with pytest.raises(_Seen):
        step_fn(TrainState(), make_samples(2))
    assert seen == ["meta"]


def test_a_model_with_one_trainable_parameter_trains():
    model = make_model()
    model.requires_grad_(False)
    model.head.bias.requires_grad_(True)
    before = model.head.bias.detach().clone()
    metrics = _step(model, causal_lm_loss, make_samples(2), lr=0.5, max_grad_norm=1.0)
    assert metrics["grad_norm"] > 0 and not torch.equal(model.head.bias, before)


def test_step_end_runs_after_the_schedulers_every_step_and_its_metrics_join_the_steps():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    seen = []

    def step_end():
        seen.append(scheduler.last_epoch)
        return {"router/bias": torch.tensor(float(len(seen)))}

    step_fn = make_train_step(model, causal_lm_loss, optimizer, scheduler, step_end=step_end)
    first = step_fn(TrainState(), make_samples(2))
    second = step_fn(TrainState(global_step=1, cursor=1), make_samples(2))
    assert seen == [1, 2]  # after the scheduler stepped
    assert (first["router/bias"], second["router/bias"]) == (1.0, 2.0) and second["lr"] == 0.25

    def clashing():
        return {"loss": torch.tensor(0.0)}

    step_fn = make_train_step(model, causal_lm_loss, optimizer, step_end=clashing)
    with pytest.raises(ValueError, match=r"^step_end metrics \['loss'\] collide with the step's own$"):
        step_fn(TrainState(), make_samples(2))


def test_with_several_ranks_a_lone_micro_batchs_metrics_are_weighted_like_its_loss(monkeypatch):
    """A rank's share of the global tokens scales its metrics as it scales its loss, so their mean over
    ranks is the global token-weighted mean, with one micro-batch too."""
    monkeypatch.setattr(step_module, "dist", FakeDist(other_tokens=7))
    metrics = _step(make_model(), _loss_with_metrics, [make_samples(2)], dp_size=2)
    torch.testing.assert_close(metrics["echo"], metrics["loss"], **EXACT)
    tokens = int(count_loss_tokens(make_samples(2)))
    torch.testing.assert_close(metrics["rows"], torch.tensor(2.0 * tokens * 2 / (tokens + 7)), **EXACT)
