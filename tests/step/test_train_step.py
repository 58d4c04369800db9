"""The training step [S21]-[S26]: accumulation, token weighting (micro-batches and ranks), zero-token
rules, clipping, order, non-finite handling, mixed precision, gradient-sync control."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fntrain.state import TrainState
from fntrain.step import StepSettings, causal_lm_loss, make_train_step
from fntrain.step import train_step as step_module

VOCAB, WIDTH, SEQ = 11, 8, 6
EXACT = {"rtol": 1e-5, "atol": 1e-6}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(input_ids))))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_samples(count: int, seed: int = 1, keep: float | list[float] = 1.0) -> dict[str, torch.Tensor]:
    """`count` sequences; sample i keeps a fraction keep[i] of its labels (others -100)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)
    labels = ids.clone()
    fractions = keep if isinstance(keep, list) else [keep] * count
    noise = torch.rand(count, SEQ, generator=generator)
    for i, fraction in enumerate(fractions):
        labels[i, noise[i] >= fraction] = -100
    return {"input_ids": ids, "labels": labels}


def split(batch: dict[str, torch.Tensor], sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    out, start = [], 0
    for size in sizes:
        out.append({k: v[start : start + size] for k, v in batch.items()})
        start += size
    return out


def run_step(model, micro_batches, **kwargs):
    """One step with SGD(lr=0): returns (metrics, gradients as the optimizer saw them)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads: dict[str, torch.Tensor] = {}

    def capture(opt, args, kw):
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    optimizer.register_step_pre_hook(capture)
    scaler = kwargs.pop("grad_scaler", None)
    step_fn = make_train_step(model, causal_lm_loss, optimizer, settings=StepSettings(**kwargs), grad_scaler=scaler)
    metrics = step_fn(TrainState(), micro_batches)
    return metrics, grads


def assert_same_grads(got: dict, expected: dict, **tolerance) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **(tolerance or EXACT), msg=name)


# ----------------------------------------------------------------------------- accumulation and weighting


@pytest.mark.parametrize("loss_weighting", ["token", "mean"])
def test_micro_batches_accumulate_to_the_gradient_of_one_batch(loss_weighting):
    batch = make_samples(8)
    big_metrics, big = run_step(make_model(), [batch], loss_weighting=loss_weighting)
    metrics, accumulated = run_step(make_model(), split(batch, [2, 2, 2, 2]), loss_weighting=loss_weighting)
    assert_same_grads(accumulated, big)
    torch.testing.assert_close(metrics["loss"], big_metrics["loss"], **EXACT)


def test_token_weighting_with_uneven_micro_batches_equals_the_concatenated_batch():
    batch = make_samples(7, keep=[0.0, 0.0, 0.2, 1.0, 0.5, 0.9, 0.1])  # first micro-batch: zero tokens
    expected_loss = causal_lm_loss(make_model()(batch["input_ids"]), batch)
    big_metrics, big = run_step(make_model(), [batch])
    metrics, grads = run_step(make_model(), split(batch, [2, 1, 3, 1]))
    assert_same_grads(grads, big)
    torch.testing.assert_close(metrics["loss"], expected_loss.detach(), **EXACT)
    torch.testing.assert_close(big_metrics["loss"], expected_loss.detach(), **EXACT)


def test_mean_mode_is_the_plain_mean_over_micro_batches():
    batch = make_samples(4, keep=[0.1, 0.1, 1.0, 1.0])
    parts = split(batch, [2, 2])
    model = make_model()
    per_micro = [causal_lm_loss(model(p["input_ids"]), p).detach() for p in parts]
    metrics, _ = run_step(make_model(), parts, loss_weighting="mean")
    torch.testing.assert_close(metrics["loss"], (per_micro[0] + per_micro[1]) / 2, **EXACT)
    token_metrics, _ = run_step(make_model(), parts, loss_weighting="token")
    assert not torch.allclose(token_metrics["loss"], metrics["loss"])  # the data makes the modes differ


class FakeDist:
    """Two data-parallel ranks, simulated one at a time: all_reduce adds the other rank's token count."""

    def __init__(self, other_tokens: int):
        self.other_tokens = other_tokens
        self.reduced = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group=None) -> int:
        return 2

    def all_reduce(self, tensor, group=None):
        self.reduced += 1
        tensor += self.other_tokens


def test_token_weighting_across_ranks_equals_the_concatenated_batch(monkeypatch):
    """Uneven tokens across micro-batches *and* ranks: the DDP/FSDP2 average of the two ranks'
    gradients and the mean of their reported losses are those of one concatenated batch."""
    from fntrain.data.tokens import count_loss_tokens

    batch = make_samples(8, keep=[0.0, 0.0, 0.1, 0.3, 1.0, 1.0, 0.8, 0.6])
    ranks = [split(batch, [2, 2]), split({k: v[4:] for k, v in batch.items()}, [1, 3])]
    ranks[0] = split({k: v[:4] for k, v in batch.items()}, [2, 2])
    tokens = [sum(int(count_loss_tokens(mb)) for mb in rank) for rank in ranks]
    assert tokens[0] * 3 < tokens[1]

    losses, grads = [], []
    for rank in range(2):
        fake = FakeDist(other_tokens=tokens[1 - rank])
        monkeypatch.setattr(step_module, "dist", fake)
        metrics, rank_grads = run_step(make_model(), ranks[rank], dp_size=2)
        assert fake.reduced == 1  # the step's only collective: the token count
        losses.append(metrics["loss"])
        grads.append(rank_grads)
    monkeypatch.undo()

    big_metrics, big = run_step(make_model(), [batch])
    averaged = {name: (grads[0][name] + grads[1][name]) / 2 for name in big}  # what DDP/FSDP2 do
    assert_same_grads(averaged, big)
    torch.testing.assert_close((losses[0] + losses[1]) / 2, big_metrics["loss"], **EXACT)


def test_padding_micro_batch_counts_zero_tokens():
    batch = make_samples(4)
    padding = dict(make_samples(2, seed=9), is_padding=True)  # real labels, flagged as padding
    _, without = run_step(make_model(), split(batch, [2, 2]))
    metrics, with_padding = run_step(make_model(), [*split(batch, [2, 2]), padding])
    assert_same_grads(with_padding, without)
    assert torch.isfinite(metrics["loss"])


# ----------------------------------------------------------------------------- zero-token steps


def test_zero_token_step_has_zero_loss_and_zero_gradient():
    batch = make_samples(4, keep=0.0)
    metrics, grads = run_step(make_model(), split(batch, [2, 2]))
    assert metrics["loss"].item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_zero_token_step_with_a_non_zero_loss_is_a_value_error():
    def mean_over_everything(output, micro_batch):  # ignores the label mask: wrong on an empty step
        return output.float().pow(2).mean()

    model = make_model()
    step_fn = make_train_step(model, mean_over_everything, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"step 4 has zero loss tokens but a non-zero loss"):
        step_fn(TrainState(global_step=3, cursor=3), split(make_samples(4, keep=0.0), [2, 2]))


def test_loss_that_is_nan_on_an_empty_micro_batch_is_caught():
    def plain_mean(output, micro_batch):  # F.cross_entropy's mean is NaN when every label is ignored
        logits = output[:, :-1].reshape(-1, VOCAB)
        return nn.functional.cross_entropy(logits, micro_batch["labels"][:, 1:].reshape(-1))

    model = make_model()
    step_fn = make_train_step(model, plain_mean, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FloatingPointError, match="non-finite loss at step 1"):
        step_fn(TrainState(), [make_samples(2, keep=0.0), make_samples(2)])


# ----------------------------------------------------------------------------- clipping, order, metrics


def test_clipping_reports_the_pre_clip_norm_and_clips():
    batch = make_samples(4)
    _, raw = run_step(make_model(), [batch])
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in raw.values()]))
    assert expected_norm > 0.05
    metrics, clipped = run_step(make_model(), [batch], max_grad_norm=0.05)
    torch.testing.assert_close(metrics["grad_norm"], expected_norm, **EXACT)
    clipped_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped.values()]))
    torch.testing.assert_close(clipped_norm, torch.tensor(0.05), rtol=1e-4, atol=1e-6)

    metrics, unclipped = run_step(make_model(), [batch], max_grad_norm=0.0)
    assert metrics["grad_norm"] == 0.0  # a host float: no device op when not clipping
    assert_same_grads(unclipped, raw)


def test_metrics_are_device_tensors_and_lr_a_float():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = make_train_step(model, causal_lm_loss, optimizer, settings=StepSettings(max_grad_norm=1.0))(
        TrainState(), make_samples(2)
    )
    assert set(metrics) == {"loss", "grad_norm", "lr", "loss_tokens"}
    assert metrics["loss_tokens"].dtype == torch.int64
    for name in ("loss", "grad_norm"):
        assert isinstance(metrics[name], torch.Tensor) and metrics[name].dim() == 0
        assert not metrics[name].requires_grad
    assert metrics["lr"] == 0.5


def test_order_is_optimizer_step_zero_grad_scheduler_step_for_every_optimizer():
    model = make_model()
    calls: list[str] = []
    first = torch.optim.SGD([model.embed.weight], lr=0.1)
    second = torch.optim.SGD([*model.mix.parameters(), *model.head.parameters()], lr=0.2)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step) for opt in (first, second)]
    for name, opt in (("first", first), ("second", second)):
        opt.register_step_post_hook(lambda *a, name=name: calls.append(f"step {name}"))
        original = opt.zero_grad
        opt.zero_grad = lambda set_to_none=True, name=name, original=original: (
            calls.append(f"zero {name}"),
            original(set_to_none),
        )
    for name, scheduler in zip(("first", "second"), schedulers, strict=True):
        original_step = scheduler.step
        scheduler.step = lambda name=name, original_step=original_step: (
            calls.append(f"sched {name}"),
            original_step(),
        )
    before = model.embed.weight.detach().clone()
    metrics = make_train_step(model, causal_lm_loss, [first, second], schedulers)(
        TrainState(), make_samples(2)
    )
    assert calls == ["step first", "step second", "zero first", "zero second", "sched first", "sched second"]
    assert not torch.equal(before, model.embed.weight)
    assert all(p.grad is None for p in model.parameters())
    assert metrics["lr"] == pytest.approx(0.2)  # the rate the step used: the schedulers step after it


def test_a_lone_mapping_is_one_micro_batch():
    batch = make_samples(4)
    _, as_list = run_step(make_model(), [batch])
    _, as_mapping = run_step(make_model(), batch)
    assert_same_grads(as_mapping, as_list)


# ----------------------------------------------------------------------------- non-finite losses


def poisoned_model() -> TinyLM:
    model = make_model()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    return model


def test_non_finite_loss_raises_naming_the_step():
    model = poisoned_model()
    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FloatingPointError, match="non-finite loss at step 8"):
        step_fn(TrainState(global_step=7, cursor=2), make_samples(2))


def test_skip_mode_skips_the_update_and_the_scheduler():
    model = poisoned_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    before = copy.deepcopy(model.state_dict())
    step_fn = make_train_step(
        model, causal_lm_loss, optimizer, scheduler, settings=StepSettings(nonfinite="skip", max_grad_norm=1.0)
    )
    metrics = step_fn(TrainState(), make_samples(2))
    assert metrics["skipped"] == 1.0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True)
    assert scheduler.last_epoch == 0 and all(p.grad is None for p in model.parameters())

    with torch.no_grad():
        model.head.bias[0] = 0.0
    metrics = step_fn(TrainState(global_step=1, cursor=1), make_samples(2))
    assert metrics["skipped"] == 0.0 and scheduler.last_epoch == 1
    assert not torch.equal(model.mix.weight, before["mix.weight"])


# ----------------------------------------------------------------------------- mixed precision


def test_bf16_autocast_step_is_close_to_fp32():
    batch = make_samples(4)
    fp32, _ = run_step(make_model(), [batch])
    bf16, grads = run_step(make_model(), split(batch, [2, 2]), autocast_dtype=torch.bfloat16)
    torch.testing.assert_close(bf16["loss"], fp32["loss"], rtol=2e-2, atol=2e-2)
    assert all(g.dtype == torch.float32 for g in grads.values())  # master weights and grads stay fp32


def test_fp16_with_grad_scaler_unscales_before_clipping():
    batch = make_samples(4)
    fp32, reference = run_step(make_model(), [batch], max_grad_norm=100.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fp16, grads = run_step(
        make_model(), [batch], max_grad_norm=100.0, autocast_dtype=torch.float16, grad_scaler=scaler
    )
    # Unscaled: the same norm and gradients as fp32 up to fp16 rounding, not 1024 times larger.
    torch.testing.assert_close(fp16["grad_norm"], fp32["grad_norm"], rtol=2e-2, atol=1e-3)
    assert_same_grads(grads, reference, rtol=5e-2, atol=2e-3)
    assert scaler.get_scale() == 1024.0  # finite gradients: no back-off


def test_grad_scaler_skips_an_overflowing_step_by_itself():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**64)

    def steep_loss(output, micro_batch):  # finite loss whose scaled gradients overflow fp32
        return causal_lm_loss(output, micro_batch) * 1e20

    before = copy.deepcopy(model.state_dict())
    step_fn = make_train_step(model, steep_loss, optimizer, settings=StepSettings(max_grad_norm=1.0), grad_scaler=scaler)
    metrics = step_fn(TrainState(), make_samples(2))
    assert not torch.isfinite(metrics["grad_norm"])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name])
    assert scaler.get_scale() < 2.0**64
    step_fn(TrainState(global_step=1, cursor=1), make_samples(2))  # unscale_/update bookkeeping stays valid


# ----------------------------------------------------------------------------- gradient sync control [S21]


class FakeFSDP(TinyLM):
    """Records whether gradient sync was on at each forward and each backward."""

    def __init__(self) -> None:
        super().__init__()
        self.sync = True
        self.seen: list[tuple[str, bool]] = []

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.sync = requires_gradient_sync

    def forward(self, input_ids, **kw):
        self.seen.append(("forward", self.sync))
        out = super().forward(input_ids)
        out.register_hook(lambda grad: self.seen.append(("backward", self.sync)))
        return out


class FakeDDP(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.in_no_sync = False
        self.seen: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False

    def forward(self, input_ids, **kw):
        self.seen.append(("forward", not self.in_no_sync))
        out = super().forward(input_ids)
        out.register_hook(lambda grad: self.seen.append(("backward", not self.in_no_sync)))
        return out


@pytest.mark.parametrize("model_cls", [FakeFSDP, FakeDDP])
def test_gradients_sync_only_on_the_last_micro_batch(model_cls):
    torch.manual_seed(0)
    model = model_cls()
    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    step_fn(TrainState(), split(make_samples(6), [2, 2, 2]))
    syncing = [False, False, False, False, True, True]
    assert model.seen == [
        (kind, sync) for kind, sync in zip(["forward", "backward"] * 3, syncing, strict=True)
    ]
    model.seen.clear()
    step_fn(TrainState(global_step=1, cursor=1), make_samples(2))  # one micro-batch: syncs
    assert model.seen == [("forward", True), ("backward", True)]


def test_fsdp_gradient_sync_is_restored_after_a_failing_micro_batch():
    torch.manual_seed(0)
    model = FakeFSDP()
    calls = {"n": 0}

    def failing_loss(output, micro_batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return causal_lm_loss(output, micro_batch)

    step_fn = make_train_step(model, failing_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="boom"):
        step_fn(TrainState(), split(make_samples(6), [2, 2, 2]))
    assert model.sync is True


# ----------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_weighting": "sum"}, "loss_weighting must be one of"),
        ({"nonfinite": "ignore"}, "nonfinite must be one of"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be a number >= 0"),
        ({"max_grad_norm": True}, "max_grad_norm must be a number >= 0"),
        ({"dp_size": 0}, "dp_size must be a positive int"),
        ({"dp_size": 2}, "dp_size=2 needs an initialized process group"),
        ({"autocast_dtype": torch.float64}, "autocast_dtype must be None"),
    ],
)
def test_bad_arguments_are_rejected_at_build_time(kwargs, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1), settings=StepSettings(**kwargs))


def test_empty_batch_is_an_error_naming_the_step():
    model = make_model()
    step_fn = make_train_step(model, causal_lm_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="step 1: the batch holds no micro-batches"):
        step_fn(TrainState(), [])


def test_device_assert_falls_back_when_the_backend_lacks_assert_async(monkeypatch, caplog):
    monkeypatch.setattr(step_module, "_ASSERT_MODES", {})
    step_module._device_assert(torch.tensor(True), "fine", FloatingPointError)
    with pytest.raises(RuntimeError, match="bad step 3"):  # torch._assert_async itself (sync on CPU)
        step_module._device_assert(torch.tensor(False), "bad step 3", FloatingPointError)

    def missing(*args):
        raise NotImplementedError("Could not run 'aten::_assert_async.msg'")

    monkeypatch.setattr(torch, "_assert_async", missing)
    with pytest.raises(FloatingPointError, match="bad step 4"):
        step_module._device_assert(torch.tensor(False), "bad step 4", FloatingPointError)
    assert step_module._ASSERT_MODES == {"cpu": "host"}
    assert "now cost a host sync" in caplog.text
